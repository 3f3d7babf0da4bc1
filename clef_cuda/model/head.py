"""The joint schema head (shared/specs/clef-decision.md section 2), in torch, vectorised over questions
and options: no Python loop per option.

It consumes the trunk's final hidden states chunk by chunk, keeping only what it needs: the memory rows
M = W_mem LN(X) of every token, the sums of LN(X) over each question's and option's span, and LN(X) of
the last token. Those depend only on the tokens seen so far, which is what lets a prefix cache reuse
them. `logits` then scores every option of every question at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clef_cuda.model.config import HeadConfig
from clef_cuda.request.encoding import EncodedRecord

Tensor = torch.Tensor
LN_EPS = 1e-5
MAX_LOG_SCALE = math.log(100.0)


@dataclass
class RecordLayout:
    """Where each question's and option's tokens are, as tensors (built once per encoded record)."""

    span_of_token: Tensor  # [L] int64: the span a token belongs to, or num_spans (none); spans are disjoint
    span_lengths: Tensor  # [Q + O] questions first, then options in encoded order
    option_question: Tensor  # [O] int64: the question each option belongs to
    type_ids: Tensor  # [Q] int64
    option_token_ids: Tensor  # [sum of option span lengths] the tokens of every option span, concatenated
    option_token_owner: Tensor  # [same] the option each of those tokens belongs to
    num_questions: int
    num_options: int

    @classmethod
    def from_record(cls, record: EncodedRecord, device) -> RecordLayout:
        spans = [q.span for q in record.questions] + [s for q in record.questions for s in q.option_spans]
        span_of_token = torch.full((record.num_tokens,), len(spans), dtype=torch.int64)
        for index, (start, end) in enumerate(spans):
            span_of_token[start:end] = index
        option_question = [qi for qi, q in enumerate(record.questions) for _ in q.option_spans]
        ids = torch.tensor(record.input_ids, dtype=torch.int64)
        option_spans = spans[len(record.questions) :]
        token_ids = torch.cat([ids[s:e] for s, e in option_spans])
        owner = torch.cat([torch.full((e - s,), o, dtype=torch.int64) for o, (s, e) in enumerate(option_spans)])
        return cls(
            span_of_token=span_of_token.to(device),
            span_lengths=torch.tensor([e - s for s, e in spans], dtype=torch.float32, device=device),
            option_question=torch.tensor(option_question, dtype=torch.int64, device=device),
            type_ids=torch.tensor([q.type_id for q in record.questions], dtype=torch.int64, device=device),
            option_token_ids=token_ids.to(device),
            option_token_owner=owner.to(device),
            num_questions=len(record.questions),
            num_options=len(option_spans),
        )


@dataclass
class HeadInputs:
    """What the head keeps from the trunk's output while a record is prefilled chunk by chunk."""

    memory: Tensor  # [L, width] memory rows, filled as chunks arrive
    span_sums: Tensor  # [Q + O + 1, hidden] sums of LN(X) per span (last row: tokens in no span)
    last: Tensor | None = None  # LN(X) of the newest token so far
    filled: int = 0


def _layer_norm(x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], LN_EPS)


def _linear(x: Tensor, w: dict[str, Tensor], name: str, bias: bool = True) -> Tensor:
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"] if bias else None)


def add_by_index(out: Tensor, index: Tensor, values: Tensor, by_product: bool | None = None) -> Tensor:
    """out[index[i]] += values[i] (rows, or a vector's elements), in place; returns out.

    index_add_ adds in index order on the CPU, but on a GPU with atomics, in the order the threads arrive, so a
    record's probabilities moved in their last bits from one run to the next (1.8e-7 on an H200, 2026-12-04).
    There (by_product None on a GPU, or True) the values are summed by a 0/1 matrix product instead, an order
    the shapes fix; the CPU keeps index_add_ (the bits it always gave)."""
    if by_product is None:
        by_product = out.device.type == "cuda"
    if not by_product:
        return out.index_add_(0, index, values)
    onehot = torch.zeros(out.shape[0], index.shape[0], dtype=values.dtype, device=values.device)
    onehot[index, torch.arange(index.shape[0], device=index.device)] = 1
    return out.add_(onehot @ values)


def _segment_softmax(scores: Tensor, segment: Tensor, num_segments: int) -> Tensor:
    """Softmax of scores within each segment (scores [N], segment [N] in [0, num_segments))."""
    peak = torch.full((num_segments,), -math.inf, dtype=scores.dtype, device=scores.device)
    peak = peak.scatter_reduce(0, segment, scores, reduce="amax")
    weights = (scores - peak[segment]).exp()
    total = add_by_index(torch.zeros(num_segments, dtype=scores.dtype, device=scores.device), segment, weights)
    return weights / total[segment]


class JointSchemaHead:
    def __init__(self, config: HeadConfig, weights: dict[str, Tensor], lm_head: Tensor) -> None:
        self.config = config
        self.w = weights
        self.lm_head = lm_head  # E: raw LM-head rows give each option's lexical vector
        self.dtype = weights["memory_projection.weight"].dtype

    # ---- streaming the trunk's output -------------------------------------------------------------
    def start(self, layout: RecordLayout, num_tokens: int) -> HeadInputs:
        device = self.lm_head.device
        return HeadInputs(
            memory=torch.empty(num_tokens, self.config.width, dtype=self.dtype, device=device),
            span_sums=torch.zeros(
                layout.num_questions + layout.num_options + 1, self.config.hidden_size, dtype=self.dtype, device=device
            ),
        )

    def normed(self, hidden: Tensor) -> Tensor:
        """What the head reads of each token: LN(X) of final hidden states [n, hidden] -> [n, hidden] (its dtype).
        (Shadow verification sketches it at every position, to check the span means below against it.)"""
        return _layer_norm(hidden.to(self.dtype), self.w, "hidden_norm")

    def consume(self, inputs: HeadInputs, layout: RecordLayout, hidden: Tensor) -> None:
        """Fold the next chunk of final hidden states [n, hidden] (tokens inputs.filled ..) into inputs."""
        n = hidden.shape[0]
        normed = self.normed(hidden)
        inputs.memory[inputs.filled : inputs.filled + n] = _linear(normed, self.w, "memory_projection", bias=False)
        add_by_index(inputs.span_sums, layout.span_of_token[inputs.filled : inputs.filled + n], normed)
        inputs.last = normed[-1]
        inputs.filled += n

    # ---- scoring ---------------------------------------------------------------------------------
    def logits(self, inputs: HeadInputs, layout: RecordLayout) -> Tensor:
        """One logit per option [O] (fp32), options of all questions concatenated in encoded order."""
        w, q_count, o_count = self.w, layout.num_questions, layout.num_options
        memory = inputs.memory[: inputs.filled].unsqueeze(0)  # [1, L, W]
        means = inputs.span_sums[:-1] / layout.span_lengths[:, None]
        question_vecs, option_context = means[:q_count], means[q_count:]  # [Q, H], [O, H]
        global_vec = inputs.last  # [H]
        lexical = torch.zeros(o_count, self.config.hidden_size, dtype=self.dtype, device=memory.device)
        add_by_index(lexical, layout.option_token_owner, self.lm_head[layout.option_token_ids].to(self.dtype))
        lexical = lexical / layout.span_lengths[q_count:, None]
        question_of = layout.option_question

        # Options attend to the memory (never to each other) through the routing layers.
        routed = (
            _linear(option_context, w, "option_context_projection", bias=False)
            + _linear(lexical, w, "option_lexical_projection", bias=False)
            + _linear(question_vecs, w, "option_question_projection", bias=False)[question_of]
        ).unsqueeze(0)  # [1, O, W]
        for layer in range(self.config.routing_layers):
            p = f"evidence_layers.{layer}"
            keys = _layer_norm(memory, w, f"{p}.memory_norm")
            routed = routed + self._attention(_layer_norm(routed, w, f"{p}.query_norm"), keys, f"{p}.attention")
            hidden = F.gelu(_linear(_layer_norm(routed, w, f"{p}.feedforward_norm"), w, f"{p}.feedforward.0"))
            routed = routed + _linear(hidden, w, f"{p}.feedforward.3")
        routed = routed[0]  # [O, W]

        # Fields: the question, a softmax summary of its own options, the last token, its type.
        base = _linear(question_vecs, w, "question_projection", bias=False)  # [Q, W]
        weights = _segment_softmax(
            (routed * base[question_of]).sum(-1) / math.sqrt(self.config.width), question_of, q_count
        )
        summary = add_by_index(torch.zeros_like(base), question_of, weights[:, None] * routed)
        fields = (
            base
            + _layer_norm(summary, w, "option_summary_norm")
            + _linear(global_vec, w, "global_projection", bias=False)
            + w["type_embedding.weight"][layout.type_ids]
        ).unsqueeze(0)  # [1, Q, W]
        for layer in range(self.config.layers):  # nn.TransformerDecoderLayer, norm_first, no masks
            p = f"layers.{layer}"
            normed = _layer_norm(fields, w, f"{p}.norm1")
            fields = fields + self._attention(normed, normed, f"{p}.self_attn")
            fields = fields + self._attention(_layer_norm(fields, w, f"{p}.norm2"), memory, f"{p}.multihead_attn")
            hidden = F.gelu(_linear(_layer_norm(fields, w, f"{p}.norm3"), w, f"{p}.linear1"))
            fields = fields + _linear(hidden, w, f"{p}.linear2")
        fields = _layer_norm(fields[0], w, "field_norm")  # [Q, W]

        # Score: a lexical prior in the hidden space, plus the gated joint score.
        anchor = F.normalize(question_vecs + global_vec, dim=-1, eps=1e-12)  # [Q, H]
        prior_scale = w["prior_logit_scale"].clamp(max=MAX_LOG_SCALE).exp()
        prior = prior_scale * (F.normalize(lexical, dim=-1, eps=1e-12) * anchor[question_of]).sum(-1)
        options = _layer_norm(routed, w, "option_norm")  # [O, W]
        field = fields[question_of]  # [O, W]
        cosine = F.cosine_similarity(field, options, dim=-1, eps=1e-8)
        features = torch.cat([field, options, field * options, (field - options).abs()], dim=-1)
        residual = _linear(F.gelu(_linear(features, w, "residual_scorer.0")), w, "residual_scorer.3").squeeze(-1)
        joint_scale = w["joint_logit_scale"].clamp(max=MAX_LOG_SCALE).exp()
        logits = prior + torch.sigmoid(w["residual_gate"]) * (joint_scale * cosine + residual)
        return logits.float()

    def probabilities(self, logits: Tensor, layout: RecordLayout) -> Tensor:
        """Softmax of the fp32 logits within each question: [O]."""
        return _segment_softmax(logits.float(), layout.option_question, layout.num_questions)

    def _attention(self, queries: Tensor, memory: Tensor, name: str) -> Tensor:
        """nn.MultiheadAttention (batch_first, biases, heads x width/heads, scale 1/sqrt(head dim))."""
        w, heads = self.w, self.config.heads
        qw, kw, vw = w[f"{name}.in_proj_weight"].chunk(3)
        qb, kb, vb = w[f"{name}.in_proj_bias"].chunk(3)
        batch, n, width = queries.shape

        def split(x: Tensor) -> Tensor:
            return x.view(batch, x.shape[1], heads, width // heads).transpose(1, 2)

        q, k, v = split(F.linear(queries, qw, qb)), split(F.linear(memory, kw, kb)), split(F.linear(memory, vw, vb))
        out = F.scaled_dot_product_attention(q, k, v)
        return _linear(out.transpose(1, 2).reshape(batch, n, width), w, f"{name}.out_proj")
