"""clef-serve with the seed's key-band fault injected into every model it loads: the self-check tests run
it as a process. Test-only; nothing in clef_cuda or app imports this."""

from __future__ import annotations

import sys

from faults import KeyBandZeroedOps

from app.cli import main
from clef_cuda.decider import Decider
from clef_cuda.model.config import load_release_config

_load = Decider.from_release.__func__


def _faulty_load(cls, path, *args, **kwargs):
    key_dim = load_release_config(path).trunk.key_dim
    return _load(cls, path, *args, ops=KeyBandZeroedOps(key_dim), **kwargs)


Decider.from_release = classmethod(_faulty_load)

if __name__ == "__main__":
    sys.exit(main())
