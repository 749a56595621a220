"""trainer.log: library warnings nobody can act on are dropped (and explained once on rank 0)."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.log import KNOWN_WARNINGS, KnownWarningFilter, install_warning_filters

# The messages as the libraries log them (torch 2.13, torchao 0.18), each from its own logger.
CONTEXT_FN = ("torch._higher_order_ops.wrap", "\nDetected that context_fn is passed to torch.utils.checkpoint under "
              "torch.compile.\nPlease make sure the checkpointed region does not contain in-place ops "
              "(e.g. torch.relu_).\n")
KERNEL_PREFERENCE = ("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively "
                     "supported by torch.compile as an opaque value type. Calling register_constant() on Enum "
                     "subclasses is deprecated and will be an error in a future release.")
TORCHAO_SO = ("torchao", "Failed to load /usr/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux"
              "-gnu.so: Could not load this library: /usr/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310"
              "-x86_64-linux-gnu.so")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def capture():
    """Yields a function that attaches a record list to a logger; filters and handlers are undone after."""
    attached: list[tuple[logging.Logger, _Records, int]] = []
    filters = {k.logger: list(logging.getLogger(k.logger).filters) for k in KNOWN_WARNINGS}
    for name in filters:  # start from no filter, whatever an earlier test or setup_logging installed
        logging.getLogger(name).filters[:] = [
            f for f in logging.getLogger(name).filters if not isinstance(f, KnownWarningFilter)]

    def attach(name: str) -> _Records:
        lg = logging.getLogger(name)
        records = _Records()
        attached.append((lg, records, lg.level))
        lg.addHandler(records)
        lg.setLevel(logging.INFO)
        return records

    yield attach
    for lg, records, level in attached:
        lg.removeHandler(records)
        lg.setLevel(level)
    for name, old in filters.items():
        logging.getLogger(name).filters[:] = old


@pytest.mark.parametrize("rank", [0, 1])
def test_known_warnings_are_dropped_and_explained_once_on_rank_0(capture, rank) -> None:
    ours = capture("trainer.log")
    library = {name: capture(name) for name in ("torch._higher_order_ops.wrap", "torch.utils._pytree", "torchao")}
    install_warning_filters(rank)
    for name, message in (CONTEXT_FN, CONTEXT_FN, KERNEL_PREFERENCE, TORCHAO_SO, TORCHAO_SO):
        logging.getLogger(name).warning(message)
    assert all(records.messages == [] for records in library.values())
    explained = [k.explanation for k in KNOWN_WARNINGS if k.logger == "torch._higher_order_ops.wrap"]
    assert ours.messages == (explained if rank == 0 else [])
    # Everything else those loggers say still gets through.
    logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version")
    logging.getLogger("torch.utils._pytree").warning("<enum 'MyEnum'> is an Enum subclass ...")
    assert library["torchao"].messages == ["Skipping import of cpp extensions due to incompatible torch version"]
    assert library["torch.utils._pytree"].messages == ["<enum 'MyEnum'> is an Enum subclass ..."]


def test_no_cuda_runtime_line_from_torch_itself_is_dropped(capture, monkeypatch) -> None:
    # The real producer: a CUDA build of torch that sees no GPU looks for CUDA_HOME.
    from torch.utils import cpp_extension

    records = capture("torch.utils.cpp_extension")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    cpp_extension._find_cuda_home()
    assert records.messages == ["No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"]  # torch says it
    install_warning_filters(0)
    cpp_extension._find_cuda_home()
    assert records.messages == ["No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"]  # and no more


def test_installing_twice_keeps_one_filter(capture) -> None:
    capture("torchao")
    install_warning_filters(0)
    install_warning_filters(1)
    filters = [f for f in logging.getLogger("torchao").filters if isinstance(f, KnownWarningFilter)]
    assert len(filters) == 1 and not filters[0].explain


@pytest.mark.parametrize("folder, dropped", [("/usr/lib/python3.12/site-packages/torchao/quantization", True),
                                             ("C:\\Python312\\Lib\\site-packages\\torchao", True),
                                             ("/usr/lib/python3.12/site-packages/other", False),
                                             ("/home/me/not_torchao_but_named_so", False)])
def test_torchao_escape_warning_at_compile_is_dropped_and_no_other(folder, dropped):
    import warnings

    from trainer.log import ignore_torchao_escape_warnings

    # What Python does on importing torchao 0.18's quant_api.py without a .pyc: a compile-time warning
    # (SyntaxWarning from 3.12, DeprecationWarning before) whose filename is the source file.
    source = 'def f():\n    """fqn regex like "layers\\.0"."""\n'
    sep = "\\" if "\\" in folder else "/"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ignore_torchao_escape_warnings()
        compile(source, f"{folder}{sep}quant_api.py", "exec")
        warnings.warn("another warning of torchao's", SyntaxWarning)  # not an escape sequence: kept
    escapes = [w for w in seen if "invalid escape sequence" in str(w.message)]
    assert len(escapes) == (0 if dropped else 1) and len(seen) == len(escapes) + 1
