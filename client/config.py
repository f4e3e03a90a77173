"""``dadfl.client.config`` — a site's TOML configuration (``dadfl site --config configs/site-a.toml``).

The server is the source of truth for the model, strategy and hyperparameters; a site
configures only how to reach the server, who it is, where its data lives, and where
it computes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dadfl.config import StrictModel, check_host_port
from dadfl.trust.run_policy import DEVICE, WORKLOAD_SPEC, RunPolicy


class LoaderOptions(StrictModel):
    """How the site's DataLoader reads its samples (any data source)."""

    num_workers: int = Field(0, ge=0, description="DataLoader worker processes; 0 reads in the site's process")


class PartitionData(LoaderOptions):
    """This site's share of a built-in workload's training set (demos, simulations)."""

    source: Literal["partition"] = "partition"
    scheme: Literal["iid", "dirichlet", "quantity"] = "iid"
    site_index: int = Field(ge=0)
    num_sites: int = Field(ge=1)
    alpha: float = Field(0.5, gt=0)
    seed: int = Field(0, description="partition seed: every site of a federation must use the same")
    batch_seed: int | None = Field(None, description="minibatch order seed (default seed + site_index)")

    @model_validator(mode="after")
    def _index_in_range(self) -> "PartitionData":
        if self.site_index >= self.num_sites:
            raise ValueError(f"site_index {self.site_index} must be below num_sites {self.num_sites}")
        return self


class FileData(LoaderOptions):
    """Local data: a .npz (arrays ``inputs`` and ``targets``), a .pt (dict of tensors) or a
    .csv file (a header row; every column but ``target_column`` is a feature)."""

    source: Literal["file"] = "file"
    path: Path
    target_column: str = Field("target", description="the label column of a .csv file")
    batch_seed: int = 0


class DatasetData(LoaderOptions):
    """Local data from the site's own code: ``factory(**options)`` returns a map-style
    ``torch.utils.data.Dataset`` whose items are ``(inputs, target)`` pairs."""

    source: Literal["dataset"] = "dataset"
    factory: str = Field(pattern=WORKLOAD_SPEC, description="'package.module:function'")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")
    batch_seed: int = 0


class EvaluationData(StrictModel):
    """Held-out data the site evaluates the global model on, every ``eval_every`` steps:
    a file like the training data (``path``) or a seeded share of it (``fraction``)."""

    path: Path | None = Field(None, description="held-out file, same formats as [data]")
    fraction: float | None = Field(None, gt=0, lt=1, description="share of the training data held out instead")
    seed: int = Field(0, description="which rows `fraction` holds out")

    @model_validator(mode="after")
    def _one_source(self) -> "EvaluationData":
        if (self.path is None) == (self.fraction is None):
            raise ValueError("set exactly one of evaluation.path (a held-out file) and evaluation.fraction (a share of [data])")
        return self


class ConnectConfig(StrictModel):
    server: str = Field(description="host:port of the coordinator")
    ca_cert: Path | None = Field(None, description="PEM CA certificate that signed the server's certificate")
    tls_server_name: str | None = Field(None, description="name to expect in the server certificate, if not the host")
    client_cert: Path | None = Field(None, description="PEM certificate of this site (mutual TLS), from `dadfl enroll SITE --cert`")
    client_key: Path | None = Field(None, description="PEM private key of client_cert")
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    max_attempts: int = Field(30, ge=1, description="connection attempts in a row before the site gives up")
    give_up_after_s: float = Field(
        120.0, gt=0, description="how long the site keeps trying to reach a coordinator it cannot reach (never reached, "
        "or lost since its last useful connection) before it gives up with one line; raise it for sites started long "
        "before their coordinator"
    )

    @field_validator("server")
    @classmethod
    def _host_port(cls, server: str) -> str:
        return check_host_port(server, lowest_port=1)

    @model_validator(mode="after")
    def _cert_with_key(self) -> "ConnectConfig":
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("set both connect.client_cert and connect.client_key (mutual TLS), or neither")
        return self


class SiteConfig(RunPolicy):
    site_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    token: str = Field(min_length=16)
    connect: ConnectConfig
    data: PartitionData | FileData | DatasetData = Field(discriminator="source")
    device: str = Field("auto", description="'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    state_dir: Path | None = Field(
        None,
        description="where the site keeps its strategy state between steps, so a restarted site rejoins "
        "bit-identically ('dadfl site' defaults to <site_id>-state next to the config file; unset: memory only). "
        "The states derive from the site's gradients: keep the folder as private as the data. Its <site_id>/audit.jsonl "
        "records every upload and code decision (dadfl/audit.py)",
    )
    evaluation: EvaluationData | None = Field(None, description="held-out data for federated evaluation; none: this site does not evaluate")

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not re.match(DEVICE, device):
            raise ValueError("use 'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:N' or 'mps'")
        return device
