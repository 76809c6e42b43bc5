"""Subcommands for signed evidence: ``keygen``, ``sign``, ``verify``, ``gate``, ``audit``.

:func:`register` adds them to the ``qualify`` parser's subcommands. Each handler returns an
:class:`~qualify.errors.ExitCode`: ``verify`` 0 or 3; ``gate`` 0, 1 (a required cell
failed) or 3 (integrity); ``audit`` 0, 2 (nothing to audit) or 3 (problems found). Heavy
modules are imported inside the handlers so ``qualify --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from qualify.cli.outputs import output_dir, output_file
from qualify.display import printable
from qualify.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from qualify.evidence.gate import GateResult

__all__ = ["register"]


def _cmd_keygen(args: argparse.Namespace) -> ExitCode:
    from qualify.evidence.keys import PRIVATE_KEY_SUFFIX, default_keys_dir, generate_key

    private = Path(args.private_key).expanduser() if args.private_key else \
        Path("~/.config/qualify").expanduser() / f"{args.name}{PRIVATE_KEY_SUFFIX}"
    output_dir(private.parent, "--private-key")  # its missing levels are made, mode 0700
    if private.parent.is_dir():
        output_file(private, "--private-key")  # a file there: generate_key refuses it
    output_dir(args.public_dir, "--public-dir")
    key, pub = generate_key(private, Path(args.public_dir), name=args.name)
    print(f"keyid {key.keyid}")
    print(f"private key: {printable(private)} (mode 0600; never commit it)")
    print(f"public key:  {printable(pub)}")
    keys = default_keys_dir()
    if pub is not None and pub.parent.resolve() != keys.resolve():
        print(f"to trust it: copy {printable(pub)} into {printable(keys)}/ and commit it")
    return ExitCode.OK


def _cmd_sign(args: argparse.Namespace) -> ExitCode:
    from qualify.evidence.keys import default_signing_key, load_signing_key, trusted_keys
    from qualify.evidence.sign import sign_directory

    directory = _existing_dir(args.dir, "evidence directory")  # before the key's notice
    output_dir(directory, "evidence directory")  # the attestation is written there
    if args.reference is not None:
        _existing_dir(args.reference, "--reference")
    trusted = trusted_keys(args.keys)  # a bad --keys: refused before anything is signed
    key = load_signing_key(args.key) if args.key else default_signing_key()
    path = sign_directory(directory, key, reference_dir=args.reference)
    print(f"{printable(path)}: signed by keyid {key.keyid} ({printable(key.source)})")
    if key.keyid not in trusted:
        print(f"note: keyid {key.keyid[:16]} is not a trusted key in "
              f"{printable(args.keys or 'contracts/keys')}; verify and gate will reject it",
              file=sys.stderr)
    return ExitCode.OK


def _existing_dir(value: str, what: str) -> Path:
    """``value`` as a directory path, or a one-line usage error (exit 2)."""
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{path}: {what}: no such file or directory")
    if not path.is_dir():
        raise UsageError(f"{path}: {what}: not a directory")
    return path


def _output_file(value: str | None, option: str) -> str | None:
    """``value`` as a file to write, checked before any work.

    Its directory must exist and be writable and it must not be a directory itself
    (:func:`qualify.cli.outputs.output_file`): a one-line usage error (exit 2) before
    verifying, instead of a crash that loses the verdict.
    """
    if value is None:
        return None
    output_file(value, option)
    return value


def _cmd_verify(args: argparse.Namespace) -> ExitCode:
    from qualify.contract import load_contract
    from qualify.evidence import store
    from qualify.evidence.sign import ATTESTATION_FILE
    from qualify.evidence.verify import verify
    from qualify.layout import WRITTEN_MARKS

    _existing_dir(args.path, "evidence directory")
    _output_file(args.json, "--json")
    if args.contract is not None:  # a missing or malformed contract is the user's input
        load_contract(args.contract)
    if args.reference is not None:
        _existing_dir(args.reference, "--reference")
    if args.contracts_dir is not None:
        _existing_dir(args.contracts_dir, "--contracts-dir")
    trusted = _root_keys(args, args.contracts_dir
                         or (Path(args.contract).parent if args.contract else None))
    marks = (store.MANIFEST_FILE, ATTESTATION_FILE, store.INCOMPLETE_FILE, *WRITTEN_MARKS)
    if not any(os.path.lexists(Path(args.path) / m) for m in marks):
        # nothing qualify writes at the top of a reference or run: a wrong path, not
        # tampering (a run or reference stripped of some of these still fails verification)
        raise UsageError(f"{args.path}: not a reference or run directory (none of "
                         f"{', '.join(marks)}; `qualify audit` checks a folder of them)")
    result = verify(Path(args.path), trusted=trusted, trusted_keys_dir=args.keys,
                    contract=args.contract, contracts_dir=args.contracts_dir,
                    reference_dir=args.reference)
    print("\n".join(result.summary_lines()))
    if args.json:
        store.atomic_write_json(args.json, result.to_dict())
    return result.exit_code


def _cmd_gate(args: argparse.Namespace) -> ExitCode:
    from qualify.cli.baseline import AUTO, NONE, baselines
    from qualify.cli.summary import print_gate
    from qualify.evidence import store
    from qualify.evidence.gate import GATE_SCHEMA, gate

    evidence = _existing_dir(args.evidence_dir, "evidence directory")
    _output_file(args.json, "--json")
    _output_file(args.junit_xml, "--junit-xml")
    _output_file(args.summary, "--summary")
    if args.sources_root is not None:
        _existing_dir(args.sources_root, "--sources-root")
    if args.baseline not in (AUTO, NONE):
        _existing_dir(args.baseline, "--baseline")
    result = gate(evidence, args.contract, allow_not_run=args.allow_not_run,
                  trusted_keys_dir=args.keys, reference_dir=args.reference,
                  policy=args.policy, sources_root=args.sources_root,
                  trust_from=args.trust_from)
    found = baselines(result, args.baseline, keys=args.keys, reference_dir=args.reference)
    if args.json:  # the decision (as gate() writes it) and what changed since the baseline
        store.atomic_write_json(args.json, {**result.to_dict(),
                                            "baselines": [b.to_dict() for b in found]},
                                schema=GATE_SCHEMA)
    print_gate(result)
    for b in found:
        print("\n".join(b.lines()))
    _write_ci_views(args, result, "".join(f"\n{b.markdown()}" for b in found))
    return result.exit_code


def _write_ci_views(args: argparse.Namespace, result: GateResult, extra: str = "") -> None:
    """Write ``--junit-xml`` (replaced) and ``--summary`` (appended, as CI summaries are)."""
    from qualify.evidence.junit import write_views

    write_views(result, junit_xml=args.junit_xml, summary=args.summary,
                command="qualify gate", extra_markdown=extra)


def _cmd_audit(args: argparse.Namespace) -> ExitCode:
    from qualify.evidence import store
    from qualify.evidence.audit import audit, render

    _output_file(args.output, "--output")
    _output_file(args.junit_xml, "--junit-xml")
    if args.sources_root is not None:
        _existing_dir(args.sources_root, "--sources-root")
    trusted = _root_keys(args, args.contracts_dir,
                         stream=None if args.format == "table" else sys.stderr)
    result = audit(args.dirs, trusted=trusted, trusted_keys_dir=args.keys,
                   contracts_dir=args.contracts_dir, source_root=args.sources_root)
    text = render(result, args.format)
    print(text)
    if args.output:
        store.atomic_write_text(args.output, text + "\n")
    if args.junit_xml:
        from qualify.evidence.junit import audit_junit

        store.atomic_write_text(args.junit_xml, audit_junit(result))
    return result.exit_code


def _ci_views_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--junit-xml", metavar="PATH",
                   help="write a JUnit XML report: one testcase per cell (XFAIL and allowed "
                        "NOT_RUN as skipped, the first failing quantity as the failure)")
    p.add_argument("--summary", metavar="PATH",
                   help="append a Markdown job summary (e.g. \"$GITHUB_STEP_SUMMARY\")")


def _root_keys(args: argparse.Namespace, contracts_dir: str | Path | None, *,
               stream: TextIO | None = None) -> Mapping[str, Ed25519PublicKey] | None:
    """``--trust-from``'s keys for ``verify`` / ``audit``, else ``None``.

    The root and any checkout key it does not trust are printed to ``stream`` (stdout). The
    checkout's contracts directory is ``contracts_dir`` (default ``./contracts``).

    Raises:
        UsageError: ``--trust-from`` with ``--keys``, or a root that cannot be read.
    """
    if args.trust_from is None:
        return None
    from qualify.evidence.trust import root_keys

    if args.keys is not None:
        raise UsageError("--trust-from takes the trusted keys from the trust root; drop --keys")
    found = root_keys(args.trust_from, contracts_dir=Path(contracts_dir or "contracts"))
    print("\n".join(found.lines()), file=stream or sys.stdout)
    return found.trusted


def _trust_from_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-from", metavar="ROOT",
                   help="trust only the keys of a protected root: a git ref (origin/main, "
                        "the merge base) or a directory outside the checkout laid out as "
                        "contracts/ (keys/*.pub); keys the checkout adds are not trusted. "
                        "Not with --keys")


def _keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", metavar="DIR",
                   help="directory of trusted public keys *.pub (default contracts/keys)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``keygen``, ``sign``, ``verify``, ``gate`` and ``audit`` to ``sub``.

    Args:
        sub: the ``qualify`` parser's subparsers action.
    """
    p = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    p.add_argument("--name", default="qualify", help="label of the key (public key file name)")
    p.add_argument("--private-key", metavar="FILE",
                   help="private key PEM, mode 0600 (default ~/.config/qualify/"
                        "<name>-signing-key.pem)")
    p.add_argument("--public-dir", default=".", metavar="DIR",
                   help="where <name>-<keyid16>.pub goes (default: current directory)")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("sign", help="attest a sealed reference or candidate run "
                                    "(attestation.dsse.json)")
    p.add_argument("dir", help="sealed reference or candidate-run directory")
    p.add_argument("--key", metavar="FILE",
                   help="PEM private key (default $QUALIFY_SIGNING_KEY, "
                        "$QUALIFY_SIGNING_KEY_FILE, else the per-user development key)")
    p.add_argument("--reference", metavar="DIR", help="the run's reference (default run.json)")
    _keys_arg(p)
    p.set_defaults(func=_cmd_sign)

    p = sub.add_parser("verify", help="verify a signed reference or run (exit 0 or 3)")
    p.add_argument("path", help="sealed, signed reference or candidate-run directory")
    _keys_arg(p)
    p.add_argument("--contract", metavar="FILE",
                   help="committed contract (default contracts/<name>.toml)")
    p.add_argument("--contracts-dir", metavar="DIR", help="directory of committed contracts")
    p.add_argument("--reference", metavar="DIR", help="the run's reference (default run.json)")
    p.add_argument("--json", metavar="OUT", help="write the verification result as JSON")
    _trust_from_arg(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gate", help="CI merge gate: verified, fresh evidence and every "
                                    "required cell PASS or failing as its policy expects "
                                    "(exit 0, 1 or 3)")
    p.add_argument("evidence_dir", help="a run directory or a directory of runs (evidence/)")
    p.add_argument("--contract", action="append", required=True, metavar="FILE",
                   help="committed contract to gate on (repeatable)")
    p.add_argument("--allow-not-run", action="append", default=[], metavar="GLOB",
                   help="cell-id glob allowed to be NOT_RUN, e.g. 'deepspeed-*' (repeatable; "
                        "in addition to the policy's allowed_not_run)")
    p.add_argument("--policy", metavar="FILE",
                   help="gate policy TOML (default contracts/gates/<contract>.toml beside the "
                        "contract; one --contract only)")
    p.add_argument("--sources-root", metavar="DIR",
                   help="code the runs' sources.json is compared with (default: the code "
                        "this qualify runs)")
    p.add_argument("--json", metavar="OUT", help="write the decision (gate.schema.json)")
    _ci_views_args(p)
    p.add_argument("--reference", metavar="DIR", help="the runs' reference (default run.json)")
    p.add_argument("--trust-from", metavar="ROOT",
                   help="take trusted keys, gate policy and contract from a protected root: "
                        "a git ref (origin/main, the merge base) or a directory outside the "
                        "checkout laid out as contracts/ (keys/, gates/, <name>.toml); a "
                        "change that alters them is refused (exit 3). Not with --keys or "
                        "--policy")
    p.add_argument("--baseline", default="auto", metavar="RUN|auto|none",
                   help="show what changed since the last accepted run of the same contract "
                        "(information; the exit code is the gate's): auto (default) = the "
                        "newest run in the --trust-from ref, else the newest older run here "
                        "whose sealed decision is PASS and that verifies; a run directory; "
                        "or none")
    _keys_arg(p)
    p.set_defaults(func=_cmd_gate)

    p = sub.add_parser("audit", help="table of every reference and run below DIR and every "
                                     "problem (exit 3 if any, 2 if nothing to audit)")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="directories to walk")
    p.add_argument("--format", choices=("table", "json", "md"), default="table")
    p.add_argument("--output", metavar="FILE", help="also write the rendering there")
    p.add_argument("--junit-xml", metavar="PATH",
                   help="write a JUnit XML report: one testcase per reference or run")
    p.add_argument("--contracts-dir", metavar="DIR", help="directory of committed contracts")
    p.add_argument("--sources-root", metavar="DIR",
                   help="code the runs' sources.json is compared with (default: the code "
                        "this qualify runs)")
    _keys_arg(p)
    _trust_from_arg(p)
    p.set_defaults(func=_cmd_audit)
