"""Small models covering every capture case: MLP, convs, recurrent cells, attention, norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def per_sample_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample; sequence outputs (B, T, V) reduce to (B, T)."""
    if outputs.dim() == 3:
        return F.cross_entropy(outputs.transpose(1, 2), targets, reduction="none")
    return F.cross_entropy(outputs, targets, reduction="none")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


class ConvNet(nn.Module):
    """Strided + padded conv, grouped + dilated conv, reflect-padded Conv1d, Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(8, 8, kernel_size=3, padding=2, dilation=2, groups=4)
        self.conv3 = nn.Conv1d(8, 6, kernel_size=3, padding=1, padding_mode="reflect", bias=False)
        self.head = nn.Linear(6 * 16, 5)

    def forward(self, x):
        x = F.relu(self.conv1(x))  # (B, 8, 4, 4)
        x = F.relu(self.conv2(x))  # (B, 8, 4, 4)
        x = F.relu(self.conv3(x.flatten(2)))  # (B, 6, 16)
        return self.head(x.flatten(1))


class LinearGRU(nn.Module):
    """GRU from Linear cells, unrolled: each Linear is called once per time step."""

    def __init__(self, vocab=7, embed=6, hidden=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.input_gates = nn.Linear(embed, 3 * hidden)
        self.hidden_gates = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)
        self.hidden = hidden

    def forward(self, tokens):
        x = self.embed(tokens)
        h = x.new_zeros(x.shape[0], self.hidden)
        outputs = []
        for t in range(x.shape[1]):
            xr, xz, xn = self.input_gates(x[:, t]).chunk(3, dim=1)
            hr, hz, hn = self.hidden_gates(h).chunk(3, dim=1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            h = (1 - z) * torch.tanh(xn + r * hn) + z * h
            outputs.append(self.head(h))
        return torch.stack(outputs, dim=1)


class TinyTransformer(nn.Module):
    """One causal attention block from Linear layers, LayerNorm, tied embedding, raw Parameter."""

    def __init__(self, vocab=7, d=8, seq=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
        x = x + self.proj(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)


class NormNet(nn.Module):
    """BatchNorm (running statistics as buffers) and LayerNorm between Linear layers."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2, self.ln, self.fc3 = (
            nn.Linear(12, 16, bias=False),  # a bias before BatchNorm has no gradient
            nn.BatchNorm1d(16),
            nn.Linear(16, 16),
            nn.LayerNorm(16),
            nn.Linear(16, 5),
        )

    def forward(self, x):
        return self.fc3(F.relu(self.ln(self.fc2(F.relu(self.bn(self.fc1(x)))))))


class TiedAutoencoder(nn.Module):
    """Decodes with the encoder's weight transposed, in a functional call outside the encoder."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(12, 6)
        self.decoder_bias = nn.Parameter(torch.zeros(12))
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        z = torch.tanh(self.encoder(x))
        return self.head(F.linear(z, self.encoder.weight.t(), self.decoder_bias))


class HookedMLP(nn.Module):
    """A user's forward hook replaces the first Linear's output; the second is called by keyword."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(12, 8), nn.Linear(8, 5)
        self.first.register_forward_hook(lambda module, args, output: 2 * output + 1)

    def forward(self, x):
        return self.second(input=torch.relu(self.first(x)))


class Attention(nn.Module):
    """nn.MultiheadAttention: packed self-attention projection, and q/k/v rows of one weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.self_attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.cross_attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 7)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.self_attention(x, x, x, need_weights=False)[0]
        x = x + self.cross_attention(x, torch.tanh(x), 2 * x, need_weights=False)[0]
        return self.head(x)


class FunctionalEmbedding(nn.Module):
    """F.embedding on a raw table with padding_idx, tied to the head; a Conv1d on an unbatched call."""

    def __init__(self, vocab=7, d=6):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, d))
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding="same")
        self.unused = nn.Linear(d, d)  # never called: no gradient, no update

    def forward(self, tokens):
        x = F.embedding(tokens, self.table, padding_idx=0)  # (B, T, d)
        mixed = torch.stack([self.conv(sample.transpose(0, 1)) for sample in x])  # unbatched (d, T) calls
        return F.linear(torch.tanh(mixed.transpose(1, 2)), self.table)


def reused_activation() -> nn.Module:
    """One ReLU instance at two positions of a Sequential."""
    relu = nn.ReLU()
    return nn.Sequential(nn.Linear(12, 16), relu, nn.Linear(16, 16), relu, nn.Linear(16, 5))


def site_batches(kind: str, sizes=(5, 1, 3), seed=0):
    """One (inputs, targets) batch per site with the given (unequal) sizes."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("mlp", "norm", "tied_autoencoder", "hooked", "reused_activation"):
        return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for n in sizes]
    if kind == "cnn":
        return [(torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)) for n in sizes]
    return [(torch.randint(0, 7, (n, 5), generator=g), torch.randint(0, 7, (n, 5), generator=g)) for n in sizes]


MODELS = {"mlp": mlp, "cnn": ConvNet, "gru": LinearGRU, "transformer": TinyTransformer, "norm": NormNet}
# The cases capture once got silently wrong (tied weights used outside their call, hooks,
# fused attention projections, reused activations), and the other call forms it follows.
CAPTURE_CASES = {
    "tied_autoencoder": TiedAutoencoder,
    "hooked": HookedMLP,
    "attention": Attention,
    "functional_embedding": FunctionalEmbedding,
    "reused_activation": reused_activation,
}
MODELS.update(CAPTURE_CASES)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def exchange_step(strategy, kind: str = "mlp", sizes=(5, 1, 3)):
    """One step of ``strategy`` over sites holding ``kind`` batches of the given sizes:
    (layout, batches, sites, local results, messages, traffic)."""
    from dadfl.strategies import local_step, probe_layout
    from dadfl.strategies.step import exchange

    model = build(kind)
    batches = site_batches(kind, sizes=sizes)
    layout = probe_layout(model, batches[0][0])
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
    sites = [strategy.site(layout, model) for _ in batches]
    messages, traffic = exchange(sites, strategy.server(layout, model), locals_, step=0)
    return layout, batches, sites, locals_, messages, traffic
