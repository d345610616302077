"""Starting `ft serve` / `ft generate`: cheap checks before anything loads, then the load itself.

A big model takes minutes to load, and `ft serve` loads it behind an HTTP server that already
answers (503 on /health). What a user can get wrong is checked first, in well under a second and
without torch (but for `synthetic:` models) (`check_model`, `bind_port`): the model directory, its
config.json (the architecture and the shapes the kernels take included), the tokenizer files, the chat
template, the port. Each failure is one line (a FreeTokenError). `build_engine` then loads, saying
each phase first.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Callable

from ft.errors import ConfigError, FreeTokenError

_DEMO = (None, "", "demo")


def check_model(config) -> None:
    """Raise a one-line FreeTokenError when `config` (an EngineConfig) names a model directory
    that does not exist, a config.json that is missing or malformed or of an architecture we do not
    run, a tokenizer directory without tokenizer.json, or a chat template that is missing or does
    not compile, a checkpoint without weights, or `--device cuda[:N]` where there is no such GPU. The demo
    model is generated later, on the engine thread; it is not checked."""
    from ft.model.config import ModelConfig

    model, model_dir = config.model, None
    if model not in _DEMO:
        path = Path(model).expanduser()
        if ":" in str(model) and not path.exists():
            from ft.tools.synthetic import config_path, is_synthetic  # torch: only for synthetic:PATH

            if is_synthetic(model):
                path = config_path(model)
                if not path.is_file():
                    raise ConfigError(f"synthetic model config {path} does not exist")
                cfg = ModelConfig.from_file(path, config.model_override_fields)
                check_split(config, cfg)
                _check_kernels(config, cfg, None)
                path = None
        if path is not None:
            if not path.exists():
                raise ConfigError(f"model directory {model} does not exist")
            if not path.is_dir():
                raise ConfigError(f"model {model} is not a directory (a Hugging Face checkpoint folder)")
            # config.json: present, valid JSON, a supported architecture; splits over the GPUs asked;
            # shapes the kernels run (or take a reference path for)
            cfg = ModelConfig.from_file(path, config.model_override_fields)
            check_split(config, cfg)
            _check_kernels(config, cfg, path)
            model_dir = path
    _check_tokenizer(config, model_dir)
    if model_dir is not None:
        _check_weights(model_dir)
    _check_device(config)  # last: a model refused on CUDA says so even where no GPU is


def check_split(config, cfg) -> None:
    """--tensor-parallel-size N: every rank's share of heads and channels exists (one line if not)."""
    from ft.model.tp_split import check_split as check

    check(cfg, getattr(config, "tensor_parallel_size", 1))


def _check_kernels(config, cfg, model_dir: Path | None) -> None:
    """The model's shapes against the kernels' limits on the device it will run on
    (`ft.model.kernel_support.check_kernel_shapes`), its heads against its weights' rows
    (`check_weight_rows`; model_dir None: a synthetic model, NVFP4, no files) and --expert-policy lfu
    against read-through decode. Torch is imported only when --device auto meets a model refused on
    CUDA alone: then whether CUDA is there decides."""
    from ft.model.config import read_quantization
    from ft.model.kernel_support import check_kernel_shapes, check_weight_rows, nvfp4_formats, read_through_refusal

    nvfp4, kv_nvfp4 = (True, False) if model_dir is None else nvfp4_formats(read_quantization(model_dir))
    kv_nvfp4 = config.kv_cache_dtype == "nvfp4" or (config.kv_cache_dtype == "auto" and kv_nvfp4)

    def check(device_type: str) -> None:
        check_kernel_shapes(cfg, device_type=device_type, quantized=nvfp4, kv_nvfp4=kv_nvfp4)

    device = str(config.device).split(":")[0]
    check("cpu" if device == "auto" else device)
    if device == "auto":
        try:
            check("cuda")
        except FreeTokenError:
            if _cuda_available():
                raise
    if model_dir is not None:
        check_weight_rows(cfg, model_dir)
    why = read_through_refusal(cfg, quantized=nvfp4)
    if (why and config.expert_policy == "lfu" and config.moe_backend == "offload"
            and (device == "cuda" or device == "auto" and _cuda_available())):
        raise ConfigError(f"--expert-policy lfu needs read-through decode, which this model cannot take: {why}")


def _check_device(config) -> None:
    """--device cuda or cuda:N names a GPU this machine has (torch is imported only then)."""
    device = str(getattr(config, "device", "auto"))
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if ":" in device and device.split(":")[1].isdigit() else 0
    world = max(1, getattr(config, "tensor_parallel_size", 1))
    if count == 0:
        raise ConfigError(f"--device {device}: no CUDA GPU is available here (--device cpu runs on the CPU)")
    if index + world > count:
        raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s)"
                          + (f", {world} needed from index {index}" if world > 1 else ""))


def _check_weights(path: Path) -> None:
    """A checkpoint folder holds safetensors weights (the loader's own test, before the port is bound)."""
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
            or any(path.glob("*.safetensors"))):
        raise ConfigError(f"no safetensors weights in {path} (model.safetensors, a sharded index, or *.safetensors)")


def _cuda_available() -> bool:
    import torch  # NOTE: only for a model whose check depends on the device --device auto picks

    return torch.cuda.is_available()


def _check_tokenizer(config, model_dir: Path | None) -> None:
    from ft.engine.text.tokenizer import Tokenizer, resolve_chat_template

    tok_dir = Path(config.tokenizer).expanduser() if config.tokenizer else model_dir
    if config.tokenizer and not tok_dir.is_dir():
        raise ConfigError(f"--tokenizer: directory {config.tokenizer} does not exist")
    try:
        if tok_dir is not None:
            Tokenizer.from_dir(tok_dir, chat_template=config.chat_template,
                               model_dir=model_dir if config.tokenizer else None)
        elif config.chat_template is not None:  # the demo's tokenizer comes later; its template is ours
            resolve_chat_template(config.chat_template)
    except FileNotFoundError as e:
        hint = "" if config.tokenizer else " (load one from another directory with --tokenizer DIR)"
        raise ConfigError(f"{e}{hint}") from None
    except (OSError, ValueError) as e:  # ChatTemplateError is a ValueError; so are malformed files
        raise ConfigError(str(e)) from None


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for the HTTP server to listen on: binding it before the
    engine loads is the check that the port is free ("port N is in use" instead of a server that
    loads for minutes and then cannot listen). SO_REUSEADDR as uvicorn sets it (a port whose last
    server left connections in TIME_WAIT is free); port 0 picks a free port (getsockname says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} is in use on {host} (another server? choose one with --port)") from None
        if e.errno == errno.EACCES:
            raise ConfigError(f"port {port} on {host}: permission denied (ports below 1024 need privileges)") from None
        raise ConfigError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def build_engine(config, say: Callable[[str], None] | None = None):
    """`Engine(config)`, with a line to `say` (when given) as each phase starts: generating the demo
    checkpoint (its first use only), loading the model (with the size of its weight files). The
    weights' progress bar is the engine's (`config.progress`)."""
    if say is not None:
        if config.model in _DEMO:
            from ft.tools.demo import DEMO_DIRNAME, default_cache_dir, ensure_demo_checkpoint

            if not (default_cache_dir() / DEMO_DIRNAME / "config.json").is_file():  # written last, then renamed
                say(f"generating the demo checkpoint in {default_cache_dir()} (first use only)")
                ensure_demo_checkpoint()
            say("loading the demo model")
        elif os.path.isdir(os.path.expanduser(config.model)):
            from ft.units import format_bytes

            say(f"loading {config.model} ({format_bytes(model_bytes(os.path.expanduser(config.model)))} of weights)")
        else:
            say(f"building {config.model}")
    from ft.engine.core.engine import Engine

    return Engine(config)


def model_bytes(model_dir: str | os.PathLike[str]) -> int:
    """Bytes of the *.safetensors files in a checkpoint directory (0 when there are none)."""
    try:
        return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    except OSError:
        return 0
