"""``dadfl.workloads.text`` — character-level language modelling on Python's bundled help texts: a GRU and a transformer.

The text is ``pydoc_data.topics.topics`` (English prose and code that ships with every
Python), so no download is needed. Both models are built from ``nn.Linear`` modules
that are *reused*: the GRU's Linear layers (cell and head) run once per time step,
the transformer's on every position at once, and the transformer's output head shares its
weight with the token embedding. These are the cases where factor capture must stack
the rows of every call and send tied weights dense.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
from pydoc_data.topics import topics
from torch import nn

from .base import Split, Workload
from .common import check_positive, check_test_fraction, classification

UNKNOWN_ID = 0


def corpus() -> str:
    """All help topics, joined in key order so the text is the same on every run."""
    return "".join(topics[key] for key in sorted(topics))


def vocabulary(text: str, min_char_count: int) -> dict[str, int]:
    """Characters seen at least ``min_char_count`` times, sorted, numbered from 1.

    Rarer characters all map to ``UNKNOWN_ID`` (0), which keeps the output layer small.
    """
    counts = Counter(text)
    frequent = sorted(char for char, count in counts.items() if count >= min_char_count)
    return {char: i for i, char in enumerate(frequent, start=UNKNOWN_ID + 1)}


def _splits(
    seq_len: int, max_sequences: int, test_fraction: float, min_char_count: int, seed: int
) -> tuple[Split, Split, int]:
    """Non-overlapping windows of ``seq_len + 1`` characters, a seeded sample of them split.

    Returns the train split, the test split and the vocabulary size (unknown id included).
    """
    check_positive(seq_len=seq_len, max_sequences=max_sequences, min_char_count=min_char_count)
    check_test_fraction(test_fraction)
    text = corpus()
    char_ids = vocabulary(text, min_char_count)
    ids = torch.tensor([char_ids.get(char, UNKNOWN_ID) for char in text], dtype=torch.int64)
    num_windows = len(ids) // (seq_len + 1)
    windows = ids[: num_windows * (seq_len + 1)].view(num_windows, seq_len + 1)
    chosen = np.random.default_rng(seed).permutation(num_windows)[:max_sequences]
    num_test = round(len(chosen) * test_fraction)
    if num_test < 1 or num_test >= len(chosen):
        raise ValueError(
            f"{len(chosen)} sequences with test_fraction={test_fraction} leave an empty train or "
            "test split; raise max_sequences or change test_fraction"
        )
    test_windows = windows[torch.from_numpy(np.sort(chosen[:num_test]))]
    train_windows = windows[torch.from_numpy(np.sort(chosen[num_test:]))]
    train = Split(train_windows[:, :-1].contiguous(), train_windows[:, 1:].contiguous())
    test = Split(test_windows[:, :-1].contiguous(), test_windows[:, 1:].contiguous())
    return train, test, len(char_ids) + 1


class LinearGRUCell(nn.Module):
    """A GRU cell whose matrix products are two ``nn.Linear`` modules.

    Standard GRU equations (as ``nn.GRUCell``), gates ordered reset, update, new:
    r = σ(W_ir x + W_hr h), z = σ(W_iz x + W_hz h), n = tanh(W_in x + r ⊙ (W_hn h)),
    h' = (1 − z) ⊙ n + z ⊙ h (each W with its bias).
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_to_gates = nn.Linear(input_size, 3 * hidden_size)
        self.hidden_to_gates = nn.Linear(hidden_size, 3 * hidden_size)

    def forward(self, inputs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        input_reset, input_update, input_new = self.input_to_gates(inputs).chunk(3, dim=-1)
        hidden_reset, hidden_update, hidden_new = self.hidden_to_gates(hidden).chunk(3, dim=-1)
        reset = torch.sigmoid(input_reset + hidden_reset)
        update = torch.sigmoid(input_update + hidden_update)
        new = torch.tanh(input_new + reset * hidden_new)
        return (1 - update) * new + update * hidden


class CharGRU(nn.Module):
    """Embedding, a ``LinearGRUCell`` unrolled in Python, a Linear head at every step."""

    def __init__(self, vocab_size: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.embed = nn.Embedding(vocab_size, embed)
        self.cell = LinearGRUCell(embed, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """``(n, T)`` character ids -> ``(n, T, vocab)`` next-character logits."""
        embedded = self.embed(char_ids)
        hidden = embedded.new_zeros(len(char_ids), self.hidden_size)
        logits = []
        for step in range(char_ids.shape[1]):
            hidden = self.cell(embedded[:, step], hidden)
            logits.append(self.head(hidden))
        return torch.stack(logits, dim=1)


class CausalSelfAttention(nn.Module):
    """Multi-head softmax attention over earlier positions, every projection an ``nn.Linear``."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, d_model = x.shape
        head_dim = d_model // self.heads

        def per_head(projected: torch.Tensor) -> torch.Tensor:
            return projected.view(n, length, self.heads, head_dim).transpose(1, 2)

        query, key, value = per_head(self.query(x)), per_head(self.key(x)), per_head(self.value(x))
        scores = query @ key.transpose(-2, -1) / math.sqrt(head_dim)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(diagonal=1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        mixed = (weights @ value).transpose(1, 2).reshape(n, length, d_model)
        return self.output(mixed)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp_out(torch.relu(self.mlp_in(self.mlp_norm(x))))


class CharTransformer(nn.Module):
    """Token embedding + learned positions (a raw ``nn.Parameter``), blocks, tied head."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # small, because the head reuses it
        self.position = nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        self.blocks = nn.Sequential(*(TransformerBlock(d_model, heads) for _ in range(layers)))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """``(n, T)`` character ids, T <= seq_len -> ``(n, T, vocab)`` next-character logits."""
        length = char_ids.shape[1]
        if length > len(self.position):
            raise ValueError(
                f"sequence of length {length} is longer than the model's {len(self.position)} positions"
            )
        x = self.embed(char_ids) + self.position[:length]
        return self.head(self.final_norm(self.blocks(x)))


METRIC_NAME = "next-character accuracy"


def gru(
    seq_len: int = 32,
    embed: int = 32,
    hidden: int = 64,
    seed: int = 0,
    max_sequences: int = 4000,
    test_fraction: float = 0.2,
    min_char_count: int = 20,
) -> Workload:
    """Character GRU; loss per sample = mean next-character cross-entropy over the window."""
    check_positive(embed=embed, hidden=hidden)
    train, test, vocab_size = _splits(seq_len, max_sequences, test_fraction, min_char_count, seed)
    options = {
        "seq_len": seq_len, "embed": embed, "hidden": hidden, "seed": seed,
        "max_sequences": max_sequences, "test_fraction": test_fraction, "min_char_count": min_char_count,
    }
    return classification(
        "char-gru", lambda: CharGRU(vocab_size, embed, hidden), seed, train, test, options,
        metric_name=METRIC_NAME, label_skew=False,  # a target per character: no one class per sample
    )


def transformer(
    seq_len: int = 32,
    d_model: int = 64,
    heads: int = 4,
    layers: int = 2,
    seed: int = 0,
    max_sequences: int = 4000,
    test_fraction: float = 0.2,
    min_char_count: int = 20,
) -> Workload:
    """Causal pre-LN character transformer with a head tied to the token embedding."""
    return _transformer("char-transformer", seq_len, d_model, heads, layers, seed, max_sequences, test_fraction, min_char_count)


def _transformer(
    name: str, seq_len: int, d_model: int, heads: int, layers: int, seed: int, max_sequences: int, test_fraction: float,
    min_char_count: int,
) -> Workload:
    check_positive(d_model=d_model, heads=heads, layers=layers)
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    train, test, vocab_size = _splits(seq_len, max_sequences, test_fraction, min_char_count, seed)
    options = {
        "seq_len": seq_len, "d_model": d_model, "heads": heads, "layers": layers, "seed": seed,
        "max_sequences": max_sequences, "test_fraction": test_fraction, "min_char_count": min_char_count,
    }
    return classification(
        name, lambda: CharTransformer(vocab_size, seq_len, d_model, heads, layers), seed, train, test, options,
        metric_name=METRIC_NAME, label_skew=False,
    )


def transformer_100m(
    seq_len: int = 64,
    seed: int = 0,
    max_sequences: int = 4000,
    test_fraction: float = 0.2,
    min_char_count: int = 20,
) -> Workload:
    """The character transformer at about 100M parameters: d_model 768, 12 heads, 14 layers.

    Each block holds 12·d² + 13·d parameters (7.1M), so 14 blocks make 99.2M (12 blocks, as in
    GPT-2 small, make 85M); the ~90-character vocabulary and ``seq_len`` positions add 0.1M.
    In float32 the weights are 397 MB, Adam's moments twice that: the setting that checks a
    step never holds another full copy of the model (``bench/bench_large.py``). Keep
    ``seq_len`` and the batch small on a CPU: the activations grow with batch·seq_len·d·layers.
    """
    return _transformer("char-transformer-100m", seq_len, 768, 12, 14, seed, max_sequences, test_fraction, min_char_count)
