"""``dadfl.server.config`` — the coordinator's TOML configuration (``dadfl server --config configs/server.toml``).

Relative paths are resolved against the working directory the server starts in (what
``docker compose`` sets with ``working_dir``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dadfl.config import Precision, StrictModel, check_host_port
from dadfl.federation import FederationConfig, WireConfig
from dadfl.options import strategy_options
from dadfl.privacy.accounting import DPConfig, check_dp_strategy
from dadfl.replica import OptimizerConfig, check_dp_precision
from dadfl.strategies import STRATEGIES


MIN_PRIVATE_BATCH = 16  # an empty Poisson draw at some site: about 1e-7 per site and step


class ListenConfig(StrictModel):
    address: str = Field("127.0.0.1:50051", description="host:port to listen on; port 0 picks a free port")
    tls_cert: Path | None = Field(None, description="PEM certificate chain of the server")
    tls_key: Path | None = Field(None, description="PEM private key of the server")
    tokens: Path = Field(Path("tokens.json"), description="enrolled sites and their token hashes")
    client_ca: Path | None = Field(None, description="PEM CA certificate that signs site certificates (mutual TLS)")
    require_client_cert: bool = Field(
        False, description="refuse sites without a certificate from client_ca naming their site id (`dadfl enroll SITE --cert`)"
    )

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        return check_host_port(address, lowest_port=0)


class WorkloadConfig(StrictModel):
    """What every replica builds. ``options`` go to the factory everywhere (sent to the
    sites: model options only); ``coordinator_options`` go to it only on the coordinator
    (e.g. the path of a coordinator-side test file), never to the sites."""

    spec: str = Field("digits-mlp", description="built-in name or 'package.module:factory'")
    options: dict = Field(default_factory=dict, description="factory options sent to every site (model options)")
    coordinator_options: dict = Field(default_factory=dict, description="factory options used only here, never sent")
    path: list[Path] = Field(default_factory=list, description="folders searched for a workload module outside the project")

    @model_validator(mode="after")
    def _options_disjoint(self) -> "WorkloadConfig":
        both = sorted(set(self.options) & set(self.coordinator_options))
        if both:
            raise ValueError(f"{', '.join(both)} set in both workload.options and workload.coordinator_options; keep each option in one")
        return self


class StrategyConfig(StrictModel):
    name: str = "dad"
    options: dict = Field(default_factory=dict)
    label: str = Field("", description="name in metrics and plots (default: name(options))")

    @model_validator(mode="after")
    def _known_with_typed_options(self) -> "StrategyConfig":
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")
        strategy_options(STRATEGIES[self.name], self.options)
        return self


class TrainingConfig(StrictModel):
    steps: int = Field(100, ge=1)
    batch_size: int = Field(32, ge=1)
    eval_every: int = Field(10, ge=1, description="steps between held-out evaluations (and always after the last)")
    tensorboard: bool = Field(False, description="also write TensorBoard event files into run_dir/tensorboard (pip install 'dadfl[tensorboard]')")
    plots: bool = Field(True, description="draw the loss and held-out metric plots (PNG) into run_dir at the end of the run")
    progress_every_s: float = Field(5.0, ge=0, description="at most one progress log line per this many seconds (evaluation steps always log)")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints; 0 = only at the end")
    precision: Precision = Field(
        "fp32", description="autocast of every site's forward/backward: fp32 (none), bf16, or fp16 (loss-scaled); "
        "factors travel in it (strategies/precision.py)"
    )


class ServerConfig(StrictModel):
    run_dir: Path = Field(Path("runs/server"), description="metrics.jsonl, checkpoint.pt, model.pt")
    threads: int = Field(
        0, ge=0, description="torch CPU threads; 0 keeps torch's default. Matrix products round differently "
        "with different thread counts, so give every replica the same value for bit-identical weights"
    )
    listen: ListenConfig = ListenConfig()
    workload: WorkloadConfig = WorkloadConfig()
    strategy: StrategyConfig = StrategyConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    federation: FederationConfig = FederationConfig()
    wire: WireConfig = WireConfig()
    dp: DPConfig | None = Field(None, description="sample-level differential privacy (docs/privacy.md); off when absent")

    @field_validator("dp")
    @classmethod
    def _private_run(cls, dp: DPConfig | None, info: ValidationInfo) -> DPConfig | None:
        if dp is None:
            return dp
        if "strategy" in info.data:
            check_dp_strategy(info.data["strategy"].name)
        if "training" in info.data:
            check_dp_precision(info.data["training"].precision)
        batch_size = info.data["training"].batch_size if "training" in info.data else MIN_PRIVATE_BATCH
        if batch_size < MIN_PRIVATE_BATCH:
            raise ValueError(
                f"training.batch_size {batch_size} is too small for [dp]: a site's Poisson draw is empty with "
                f"probability about e^-batch_size, and a site with nothing to send sits the step out (the coordinator waits "
                f"phase_timeout_s for it); use at least {MIN_PRIVATE_BATCH}"
            )
        if dp.max_sample_rate is None:
            raise ValueError(
                "dp.max_sample_rate is required: the coordinator does not know the sites' record counts, so the "
                "accountant uses this bound on their sampling rates (batch_size / records), and sites above it refuse to join"
            )
        return dp

    def require_tls(self) -> tuple[Path, Path]:
        """The certificate and key, or a message on how to get them (or run --insecure)."""
        if self.listen.tls_cert is None or self.listen.tls_key is None:
            raise ValueError(
                "TLS is on by default: set listen.tls_cert and listen.tls_key in the server config "
                "(`dadfl certs --out certs` makes a development CA and server certificate), "
                "or pass --insecure to serve plain text on a trusted network"
            )
        for path in (self.listen.tls_cert, self.listen.tls_key):
            if not path.is_file():
                raise ValueError(f"TLS file {path} does not exist (listen.tls_cert / listen.tls_key)")
        if self.listen.require_client_cert and self.listen.client_ca is None:
            raise ValueError("listen.require_client_cert needs listen.client_ca, the CA that signs site certificates (e.g. certs/ca.pem)")
        if self.listen.client_ca is not None and not self.listen.client_ca.is_file():
            raise ValueError(f"listen.client_ca {self.listen.client_ca} does not exist")
        return self.listen.tls_cert, self.listen.tls_key

    def require_plain_text_allowed(self) -> None:
        """--insecure cannot check client certificates: refuse rather than silently skip them."""
        if self.listen.require_client_cert:
            raise ValueError("listen.require_client_cert needs TLS: drop --insecure (or set listen.require_client_cert = false)")
