"""An out-of-tree qualify engine: ``example_tp1`` (see ``docs/engine-guide.md``)."""
