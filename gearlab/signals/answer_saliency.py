"""``answer_nll_saliency``: GRAIL's gradient × activation saliency of the final answer (docs/credit/grail.md).

For each response with a final-answer span (gearlab.signals.spans: the marker and the value), one extra forward and
backward of the policy with its parameters frozen:

    J   = − Σ_{t ∈ answer span} log π(y_t | x, y_<t)        logits at the sampling temperature, summed over the rows
    g_p = ∂J / ∂a_p,   a_p = the leaf at sequence position p (the input embeddings, or one layer's hidden states)
    s_t = ‖ g_{P+t−1} ⊙ a_{P+t−1} ‖₂                         float32, for response index t (P = prompt width)

The position shift is the authors' (declare-lab/grail, ``compute_grail_weights``: both tensors sliced
``[:, -(T+1):-1]``): response token t is credited with the saliency of the position that predicts it. Causality
makes s_t exactly 0 after the answer span, so the sequence is cut there. Rows without an answer span get 0 and cost
no forward. Left padding is handled by position ids from the attention mask (the source passes none and runs
right-aligned batches; on unpadded rows the two coincide).

Leaf (option ``leaf``): ``embeddings`` (default), or the hidden states ``first`` (after decoder layer 0), ``middle``
(``hidden_states[L // 2]``) or ``last`` (``hidden_states[L − 1]``, the input of the last layer) of HF's
``output_hidden_states`` tuple (index 0 = embeddings, L = the final normed output).

It is not OAR-G's ``input_grad_saliency``: that one differentiates a KL of the outcome distribution under embedding
noise, reduces by |⟨g, e⟩| and is not shifted; the two share no computation.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gearlab.core.logprobs import position_ids_from_mask
from gearlab.signals.registry import SignalContext, register_signal
from gearlab.signals.saliency import _base, _input_grads_only, _layer_checkpointing
from gearlab.signals.spans import response_segments

ANSWER_NLL_SALIENCY = "answer_nll_saliency"
LEAVES = ("embeddings", "first", "middle", "last")


def _leaf(hidden_states: tuple[Tensor, ...], embeds: Tensor, leaf: str) -> Tensor:
    """The tensor whose gradient is taken: the embeddings, or one entry of HF's hidden-state tuple."""
    if leaf == "embeddings":
        return embeds
    n_layers = len(hidden_states) - 1
    return hidden_states[{"first": 1, "middle": n_layers // 2, "last": n_layers - 1}[leaf]]


@register_signal(ANSWER_NLL_SALIENCY, fake="nonneg")
def answer_nll_saliency(ctx: SignalContext) -> Tensor:
    """GRAIL's ‖∂J/∂a ⊙ a‖₂ of the answer span's negative log-likelihood, shifted one position ([B, T] float32)."""
    leaf = str(ctx.options.get("leaf", "embeddings"))
    if leaf not in LEAVES:
        raise ValueError(f"leaf must be one of {LEAVES}, got {leaf!r}")
    b, model = ctx.batch, ctx.model
    B, T = b.response_ids.shape
    P = b.prompt_ids.shape[1]
    seg = response_segments(ctx.tokenizer, b.response_ids, b.response_mask)
    span = seg.answer.to(b.response_ids.device)
    out = torch.zeros(B, T, dtype=torch.float32, device=b.response_ids.device)
    rows_all = [i for i in range(B) if bool(span[i].any())]
    if not rows_all:
        return out
    emb_layer, head = model.get_input_embeddings(), model.get_output_embeddings()
    ids_all, mask_all = b.input_ids(), b.full_attention_mask()
    mbs = max(1, int(ctx.micro_batch_size))
    with _input_grads_only(model), torch.enable_grad():
        for s in range(0, len(rows_all), mbs):
            rows = rows_all[s : s + mbs]
            idx = torch.tensor(rows, device=ids_all.device)
            last = int(max(span[i].nonzero().max() for i in rows))  # the last answer token's response index
            L = P + last + 1
            ids, mask = ids_all[idx, :L], mask_all[idx, :L]
            x = emb_layer(ids).detach().requires_grad_(True)
            with _layer_checkpointing(model):
                o = _base(model)(inputs_embeds=x, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                 use_cache=False, output_hidden_states=leaf != "embeddings")
                a = _leaf(o.hidden_states, x, leaf) if leaf != "embeddings" else x
                h = o.last_hidden_state[:, P - 1 : L - 1]  # the positions predicting response tokens 0 .. last
                # the head at the answer's positions only: J needs no other logits, and all of them (~2.5 GB per
                # 4K-token row at a 152K vocabulary, times four with softmax and gradients) dominated the pass
                sel = span[idx, : last + 1].bool()
                logits = head(h[sel]).float() / ctx.temperature
                tok = b.response_ids[idx, : last + 1][sel]
                J = -logits.log_softmax(-1).gather(-1, tok[:, None]).sum()
                (g,) = torch.autograd.grad(J, a)
            sal = (g[:, P - 1 : L - 1].float() * a[:, P - 1 : L - 1].detach().float()).norm(dim=-1)
            out[idx, : last + 1] = sal
    return out * b.response_mask.float()

