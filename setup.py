"""Package discovery that ``pyproject.toml`` cannot state (everything else lives there).

The wheel carries two top-level packages, ``qualify`` and ``harnesses`` (found, with every
subpackage, by :func:`setuptools.find_packages`), plus the committed data directories the
code locates through :mod:`qualify.resources`, mapped at build time into ``qualify/_data/``:
``contracts/`` (the JSON Schemas, the committed contracts, the trusted public keys) and
``sbatch/`` (the Slurm job scripts). The repository keeps one copy of each: the mapping
(``package_dir``) reads them where they are, nothing is copied into ``qualify/``. Which
files of them ship is ``[tool.setuptools.package-data]`` in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

#: Data packages of the wheel and the repository directory each one is built from.
DATA_PACKAGES = {
    "qualify._data.contracts": "contracts",
    "qualify._data.sbatch": "sbatch",
}

setup(
    packages=[*find_packages(include=["qualify", "qualify.*", "harnesses", "harnesses.*"]),
              *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
)
