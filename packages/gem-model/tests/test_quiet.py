"""Third-party warnings that say nothing about a run are kept off the terminal, each by its message
and origin; any other warning still shows."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from gem_model import quiet

# where each silenced warning comes from, as the H200 and CPU runs showed it (module or logger)
ORIGINS = {
    "The topology was constructed directly": "torchrec.distributed.planner.types",
    "There is a known issue with TorchRec": "torchrec.distributed.planner.storage_reservations",
    "HeuristicalStorageReservation is known": "torchrec.distributed.planner.planners",
    "`broadcast_buffers` is deprecated": "torchrec.distributed.model_parallel",
    "Please use DTensor instead": "torchrec.distributed.embedding",
    "`_get_pg_default_device` will be": "torchrec.distributed.types",
    "barrier(): using the device": "torch.distributed.c10d_logger",
    "TBE B200 optimization:": "torch.autograd.graph",
    "_fbgemm_torch_compat_table has no entry": "root",
    "is_fx_tracing will return true": "torch.fx._symbolic_trace",
    "Warning: Profiler clears events": "torch.profiler.profiler",
}
SAMPLES = {  # each message as the library writes it
    "_fbgemm_torch_compat_table has no entry": "\n            \x1b[33m\n            _fbgemm_torch_compat_table has no entry "
    "for 1.6.0+cu130 of FBGEMM;\n            cannot determine compatibility with PyTorch 2.11.0\n            \x1b[0m\n",
    "barrier(): using the device": "barrier(): using the device under current context. You can specify `device_id` ...",
    "TBE B200 optimization:": "TBE B200 optimization: device_major=9, feature_enabled=0, segment_length=1024 (Triggered internally)",
}


def _origin(entry: quiet.Silenced) -> str:
    (key,) = [k for k in ORIGINS if re.search(re.escape(k), entry.message.replace("\\", ""))]
    return key


def test_every_silenced_warning_has_a_case_here():
    assert sorted(_origin(s) for s in quiet.SILENCED) == sorted(ORIGINS)


@pytest.mark.parametrize("entry", quiet.SILENCED, ids=lambda s: _origin(s)[:30])
def test_a_silenced_warning_does_not_show(entry, capsys):
    key = _origin(entry)
    literal = re.sub(r"\\(.)", r"\1", entry.message)  # the patterns are literal text but for these samples
    message = SAMPLES.get(key, literal + " ... (the rest of the library's message)")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install()
        if entry.category is not None:
            warnings.warn_explicit(message, entry.category, "lib.py", 1, module=ORIGINS[key])
            # the same text from elsewhere, or of another category, is not ours to hide
            warnings.warn_explicit(message, entry.category, "lib.py", 1, module="my_plugin")
            assert [str(w.message) for w in seen] == [message]
        else:
            logger = logging.getLogger(None if entry.logger == "root" else entry.logger)
            records: list[logging.LogRecord] = []
            handler = logging.Handler()
            handler.emit = records.append  # type: ignore[method-assign]
            logger.addHandler(handler)
            try:
                logger.warning(message)
                logger.warning("something else that " + key)
            finally:
                logger.removeHandler(handler)
            assert [r.getMessage() for r in records] == ["something else that " + key]


def test_install_is_idempotent():
    quiet.install()
    quiet.install()
    logger = logging.getLogger("torchrec.distributed.planner.types")
    assert sum(isinstance(f, quiet._DropRecords) for f in logger.filters) == 1
