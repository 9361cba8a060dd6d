"""A PyTorch peer for batch-1 decode, timed by bench/latency.py in the same run as our
engine: the Llama decode step written plainly in PyTorch (a static KV cache of
`max_len` positions, attention by scaled_dot_product_attention over all of them with a
mask, as gpt-fast does), replayed as a CUDA graph, eager and compiled by torch.compile
(inductor, coordinate-descent tuning). Greedy; the step feeds its token to the next
replay on the GPU, so the figure is the GPU's alone (no host work between tokens).

    python3 bench/torch_decode.py MODEL_DIR   # a Llama checkpoint (safetensors); NVIDIA GPU, torch, transformers
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import ModelConfig  # noqa: E402


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, then bfloat16 times the weight."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class LlamaDecoder(torch.nn.Module):
    """One token of one sequence a call: forward(token [1], position [1]) -> logits [1, vocab],
    writing the token's K and V into the static cache at its position. Weights and
    caches are buffers, so that torch.compile takes them as inputs (the caches mutated)."""

    def __init__(self, model_dir: str, max_len: int):
        super().__init__()
        self.config = c = ModelConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()), "llama")
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(path, device="cuda"))

        def weight(name: str) -> torch.Tensor:
            return tensors[name].to(torch.bfloat16)
        cache = (1, c.num_kv_heads, max_len, c.head_dim)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            for name, value in (("ln1", weight(p + "input_layernorm.weight")),
                                ("ln2", weight(p + "post_attention_layernorm.weight")),
                                ("qkv", torch.cat([weight(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                                ("o", weight(p + "self_attn.o_proj.weight")),
                                ("gate_up", torch.cat([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")])),
                                ("down", weight(p + "mlp.down_proj.weight")),
                                ("k_cache", torch.zeros(cache, dtype=torch.bfloat16, device="cuda")),
                                ("v_cache", torch.zeros(cache, dtype=torch.bfloat16, device="cuda"))):
                self.register_buffer(f"layer{i}_{name}", value)
        self.register_buffer("embed", weight("model.embed_tokens.weight"))
        self.register_buffer("norm", weight("model.norm.weight"))
        self.register_buffer("head", weight("lm_head.weight") if "lm_head.weight" in tensors else self.embed)
        self.register_buffer("positions", torch.arange(max_len, device="cuda"))
        inv_freq = torch.from_numpy(c.rope_inv_freq()).cuda()
        angles = self.positions[:, None].float() * inv_freq[None]
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos().to(torch.bfloat16))
        self.register_buffer("sin", angles.sin().to(torch.bfloat16))

    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        c = self.config
        group = c.num_heads // c.num_kv_heads
        x = self.embed[token]
        cos, sin = self.cos[position], self.sin[position]
        mask = (self.positions <= position)[None]  # [1 query row (broadcast), max_len]
        for i in range(c.num_layers):
            def w(name: str) -> torch.Tensor:
                return getattr(self, f"layer{i}_{name}")
            q, k, v = (rms_norm(x, w("ln1"), c.rms_norm_eps) @ w("qkv").T).split([c.q_size, c.kv_size, c.kv_size], -1)
            # (a KV head's query heads are consecutive: taken as its query rows, no K/V copied)
            q = rope(q.view(1, c.num_heads, 1, c.head_dim), cos, sin).view(1, c.num_kv_heads, group, c.head_dim)
            w("k_cache").index_copy_(2, position, rope(k.view(1, c.num_kv_heads, 1, c.head_dim), cos, sin))
            w("v_cache").index_copy_(2, position, v.view(1, c.num_kv_heads, 1, c.head_dim))
            attn = F.scaled_dot_product_attention(q, w("k_cache"), w("v_cache"), attn_mask=mask)
            x = x + attn.reshape(1, c.q_size) @ w("o").T
            gate, up = (rms_norm(x, w("ln2"), c.rms_norm_eps) @ w("gate_up").T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w("down").T
        return rms_norm(x, self.norm, c.rms_norm_eps) @ self.head.T


class GraphedDecode:
    """A decode step (forward, argmax, the token and position moved on) captured as a
    CUDA graph; `step` is the module itself or its compiled form."""

    def __init__(self, step, token: torch.Tensor, position: torch.Tensor):
        self.token, self.position = token, position

        def decode() -> None:
            self.token.copy_(step(self.token, self.position).argmax(-1))
            self.position.add_(1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm-up off the default stream, as capture needs; compiles)
            for _ in range(3):
                self.position.zero_()
                decode()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            decode()

    def ms_per_token(self, prompt: list[int], new_tokens: int) -> float:
        """The prompt fed a token a step (its K/V written), then `new_tokens` greedy steps
        timed with CUDA events."""
        for i, t in enumerate(prompt):
            self.token.fill_(t)
            self.position.fill_(i)
            self.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(new_tokens):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / new_tokens


def last_logits_error(model: LlamaDecoder, model_dir: str, prompt: list[int]) -> float:
    """Relative L2 distance of the module's logits at the prompt's last token from
    transformers' bfloat16 model's: the check that the peer computes this model."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        for i, t in enumerate(prompt):
            ours = model(torch.tensor([t], device="cuda"), torch.tensor([i], device="cuda"))[0].float()
    del hf
    torch.cuda.empty_cache()
    return float((ours - theirs).norm() / theirs.norm())


def per_token_ms(model_dir: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """{"eager": ms, "compiled": ms} a token, each a CUDA graph, and "logits error":
    last_logits_error of the eager module."""
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = True
    model = LlamaDecoder(model_dir, max_len=len(prompt) + new_tokens + 8)
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        result = {"logits error": last_logits_error(model, model_dir, prompt)}
        for name, step in (("eager", model), ("compiled", torch.compile(model, fullgraph=True))):
            result[name] = GraphedDecode(step, token, position).ms_per_token(prompt, new_tokens)
    return result


if __name__ == "__main__":
    times = per_token_ms(sys.argv[1], list(range(1000, 1128)), 256)
    print(json.dumps(times, indent=1))
