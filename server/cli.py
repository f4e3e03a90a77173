"""``dadfl.server.cli`` — commands of the coordinator side: ``dadfl server``, ``dadfl enroll``, ``dadfl certs``, and
the operator's console: ``dadfl status``, ``dadfl readmit``, ``dadfl stop``.

Plain functions with typer annotations; ``dadfl/cli.py`` registers them on the ``dadfl`` app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dadfl.audit import FILE as AUDIT_FILE
from dadfl.audit import AuditError, AuditLog
from dadfl.audit import summary_lines as audit_summary
from dadfl.audit import verify as verify_audit
from dadfl.config import ConfigError, load_config
from dadfl.failures import fail, set_debug, unexpected
from dadfl.memory import return_freed_memory
from dadfl.workloads import BUILTIN

from .certs import issue_site_certificate, make_dev_certs
from .config import ServerConfig
from .console import enrolled_lines, status_lines, stop_server
from .coordinator import RunStopped, StoppedByOperator
from .enrol import enroll as issue_token
from .enrol import revoke as revoke_site
from .preflight import check_server, check_workload
from .progress import setup_logging
from .quarantine import Quarantine
from .runtime import run_server


def server(
    config: Path = typer.Option(..., "--config", help="server TOML, e.g. configs/server.toml"),
    insecure: bool = typer.Option(False, "--insecure", help="serve plain text (no TLS): trusted networks and tests only"),
    check: bool = typer.Option(False, "--check", help="check the config, TLS files, tokens file and build the workload as the run will, then exit (listens on nothing)"),
    verbose: bool = typer.Option(False, "--verbose", help="debug logging"),
    debug: bool = typer.Option(False, "--debug", help="print the traceback of a failure (never local variables)"),
) -> None:
    """Run the coordinator: wait for the sites, drive every step, checkpoint, write the model.

    SIGTERM, Ctrl-C or `dadfl stop` stop it cleanly (the step under way finishes or aborts,
    the committed steps are checkpointed, the sites are told); a second Ctrl-C at once."""
    return_freed_memory()  # model-sized buffers go back to the system when freed (dadfl/memory.py)
    set_debug(debug)
    setup_logging(verbose)
    try:
        settings = load_config(config, ServerConfig)
        if check:
            for line in check_server(settings, insecure):
                typer.echo(f"ok: {line}")
            typer.echo(f"{config}: ready; `dadfl server --config {config}{' --insecure' if insecure else ''}` would listen on {settings.listen.address}")
            return
        if insecure:
            settings.require_plain_text_allowed()
        else:
            settings.require_tls()
        run_server(settings, insecure=insecure)  # builds the workload as --check does (preflight.py), before it listens
    except ConfigError as exc:
        fail(str(exc), 2, exc)
    except (ValueError, OSError) as exc:
        fail(f"{config}: {exc}", 2, exc)
    except RunStopped as exc:
        fail(f"run stopped: {exc} (the last checkpoint is kept; start the server again to resume)", 1, exc)
    except StoppedByOperator as exc:
        typer.echo(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        unexpected(exc)


def enroll(
    site_id: Optional[str] = typer.Argument(None, help="name of the site, e.g. hospital-a"),
    config: Path = typer.Option(Path("configs/server.toml"), "--config", help="server TOML (its listen.tokens file gets the token hash)"),
    address: Optional[str] = typer.Option(None, help="host:port the site dials (default: the server's listen.address)"),
    ca_cert: Path = typer.Option(Path("certs/ca.pem"), help="path of the CA certificate on the site's machine"),
    replace: bool = typer.Option(False, "--replace", help="issue a new token for an enrolled site (the old one, and its certificate, stop working)"),
    out: Optional[Path] = typer.Option(None, help="write the site config here instead of printing it"),
    demo_share: Optional[str] = typer.Option(
        None, help="INDEX/COUNT: the site trains on share INDEX of COUNT of the built-in workload's data (demos) instead of its own file"
    ),
    data: Optional[Path] = typer.Option(None, help="the site's data file (.npz, .pt or .csv) as its machine sees it (default data/SITE_ID.npz)"),
    data_factory: Optional[str] = typer.Option(
        None, help="instead of a file: the site's own 'package.module:function' returning a map-style torch Dataset"
    ),
    data_option: list[str] = typer.Option([], "--data-option", help="KEY=VALUE passed to --data-factory (repeatable)"),
    target_column: Optional[str] = typer.Option(None, help="the label column of the site's .csv (default 'target')"),
    held_out: Optional[str] = typer.Option(
        None, help="held-out data the site evaluates on: a fraction of its data (e.g. 0.2, the default) or a file like --data; 'none': no evaluation"
    ),
    workload_path: list[Path] = typer.Option(
        [], "--workload-path", help="folder on the site's machine that holds a workload package not installed there (repeatable)"
    ),
    cert: bool = typer.Option(False, "--cert", help="also issue a site certificate signed by the federation CA (mutual TLS)"),
    ca_dir: Path = typer.Option(Path("certs"), help="with --cert: folder of the CA's ca.pem and ca.key"),
    cert_out: Path = typer.Option(Path("certs/sites"), help="with --cert: folder for SITE.pem and SITE.key"),
    revoke: bool = typer.Option(False, "--revoke", help="remove the site's token and revoke its certificate instead of enrolling"),
    list_sites: bool = typer.Option(False, "--list", help="list the enrolled sites (and which are quarantined, which revoked) instead of enrolling"),
) -> None:
    """Enrol a site (token, config), or list the sites (--list), or revoke one (--revoke).

    Issues a token (and with --cert a certificate), stores only the token's hash and prints
    the site's config. The workload is built first, as the server will: no site is enrolled
    into a run that cannot start."""
    try:
        settings = load_config(config, ServerConfig)
        if list_sites:
            for line in enrolled_lines(settings):
                typer.echo(line)
            return
        if site_id is None:
            raise ValueError("name the site to enrol (e.g. `dadfl enroll hospital-a`), or pass --list")
        if revoke:
            revoke_site(settings.listen.tokens, site_id)
            operator_record(settings.run_dir, "revoke", site=site_id)
            typer.echo(f"site {site_id} revoked in {settings.listen.tokens}: refused at every join; if connected, dropped at its next upload")
            return
        share = parse_share(demo_share) if demo_share else None
        data_text = data_table(site_id, share, data, data_factory, data_option, target_column)
        evaluation_text = evaluation_table(site_id, held_out)
        check_workload(settings)
        issued = issue_site_certificate(ca_dir, site_id, cert_out) if cert else None
        token = issue_token(settings.listen.tokens, site_id, replace=replace, cert_serial=issued[2] if issued else None)
        operator_record(settings.run_dir, "enroll", site=site_id, replace=replace, certificate=bool(issued))
    except (ConfigError, ValueError, AuditError) as exc:
        fail(str(exc), 2, exc)
    site_cert = (ca_cert.parent / f"{site_id}.pem", ca_cert.parent / f"{site_id}.key") if issued else None
    if issued:
        typer.echo(f"certificate {issued[0]} and key {issued[1]} issued for {site_id}: copy them to the site as {site_cert[0]} and {site_cert[1]}", err=True)
    text = site_config_text(
        site_id, token, address or settings.listen.address, ca_cert, data_text, workload_path, settings.workload.spec, site_cert,
        evaluation_text,
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.chmod(0o600)
        typer.echo(f"site config for {site_id} written to {out} (it holds the token: send it privately)")
    else:
        typer.echo(text)


def parse_share(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        share = int(index), int(count)
    except ValueError:
        share = (-1, 0)
    if not 0 <= share[0] < share[1]:
        raise ValueError(f"--demo-share {text!r} must look like INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 0/2")
    return share


def data_table(
    site_id: str, share: tuple[int, int] | None = None, path: Path | None = None,
    factory: str | None = None, factory_options: list[str] = (), target_column: str | None = None,
) -> str:
    """The site config's ``[data]`` table: a demo share, the site's own factory, or its file."""
    if sum(x is not None for x in (share, path, factory)) > 1:
        raise ValueError("give at most one of --demo-share, --data and --data-factory")
    if factory_options and factory is None:
        raise ValueError("--data-option needs --data-factory")
    if target_column is not None and (share or factory):
        raise ValueError("--target-column names the label column of a --data file; a demo share or a data factory has its own targets")
    if share:
        return f"""\
[data]
# Demo data: share {share[0]} of {share[1]} of the built-in workload's training set.
source = "partition"
scheme = "iid"
site_index = {share[0]}
num_sites = {share[1]}
seed = 0
"""
    if factory:
        inline = ", ".join(f"{key} = {json.dumps(value)}" for key, value in map(parse_option, factory_options))
        return f"""\
[data]
# This site's own code: a map-style torch.utils.data.Dataset of (inputs, target) items.
source = "dataset"
factory = {json.dumps(factory)}
options = {{ {inline} }}
"""
    return f"""\
[data]
# This site's own data: a .npz with arrays 'inputs' and 'targets', a .pt dict of tensors,
# or a .csv with a header row and a label column, target_column (see docs/workloads.md).
source = "file"
path = {json.dumps(str(path or f'data/{site_id}.npz'))}
target_column = {json.dumps(target_column or "target")}
"""


def evaluation_table(site_id: str, held_out: str | None) -> str:
    """The site config's ``[evaluation]`` table: a share of [data] (a fraction), a file of its
    own, or none ('none': the site trains but does not evaluate)."""
    text = (held_out or "0.2").strip()
    if text.lower() == "none":
        return "# No [evaluation]: this site trains but does not evaluate the global model.\n"
    try:
        fraction = float(text)
    except ValueError:
        fraction = None
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"--held-out {text}: a fraction must lie strictly between 0 and 1, e.g. 0.2 (or name a file, or 'none')")
    source = f"fraction = {fraction}" if fraction is not None else f"path = {json.dumps(text)}"
    return f"""\
[evaluation]
# Held-out data the site evaluates the global model on (every eval_every steps):
# fraction = 0.2 holds out a seeded fifth of [data], or path = "data/{site_id}-test.csv" names a file.
{source}
"""


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE``; the value as JSON when it parses (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise ValueError(f"--data-option {text!r} must look like KEY=VALUE, e.g. root=data/images")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def site_config_text(
    site_id: str, token: str, address: str, ca_cert: Path, data: str, workload_path: list[Path] = (), workload: str = "",
    site_cert: tuple[Path, Path] | None = None, evaluation: str | None = None,
) -> str:
    allowed = [*BUILTIN, *([workload] if workload and workload not in BUILTIN else [])]
    identity = f"client_cert = {json.dumps(str(site_cert[0]))}\nclient_key = {json.dumps(str(site_cert[1]))}\n" if site_cert else ""
    return f"""\
# Site config of {site_id!r}, issued by `dadfl enroll`. The token is shown only once:
# the server keeps only its hash. Keep this file private.
site_id = "{site_id}"
token = "{token}"
device = "auto"   # CUDA when present, else CPU
threads = 1       # torch CPU threads: 1 suits small models and machines shared by several processes;
                  # raise it on a machine of its own with a large model on CPU
workload_path = {json.dumps([str(p) for p in workload_path])}  # folders holding your own code (workload, data factory) that is not installed
# Workloads this site runs: a coordinator naming anything else is refused before its code
# is imported. Review it: the built-in ones and this federation's workload; a module prefix
# such as "hospital_wl." allows every factory of a package.
allowed_workloads = {json.dumps(allowed)}

[connect]
server = {json.dumps(address)}
ca_cert = {json.dumps(str(ca_cert))}
{identity}
{data}
{evaluation if evaluation is not None else evaluation_table(site_id, None)}"""


def certs(
    out: Path = typer.Option(Path("certs"), help="folder for ca.pem, ca.key, server.pem, server.key"),
    host: list[str] = typer.Option([], "--host", help="extra name or IP of the server (repeatable); localhost and 127.0.0.1 are always in"),
) -> None:
    """Create a development CA and a server certificate (tests, demos, docker-compose)."""
    paths = make_dev_certs(out, tuple(host))
    for path in paths.values():
        typer.echo(path)


def status(
    config: Optional[Path] = typer.Option(None, "--config", help="server TOML: its run_dir"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="the run folder itself, instead of --config"),
) -> None:
    """Show a run: phase, step, sites joined of those needed, quarantined sites, last metrics."""
    try:
        for line in status_lines(_run_dir(config, run_dir)):
            typer.echo(line)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), 2, exc)


def readmit(
    site_id: str = typer.Argument(..., help="the quarantined site"),
    config: Path = typer.Option(Path("configs/server.toml"), "--config", help="server TOML: its run_dir holds quarantine.json"),
) -> None:
    """Re-admit a quarantined site: the running coordinator admits it at its next join."""
    try:
        settings = load_config(config, ServerConfig)
        entry = Quarantine(settings.run_dir, settings.federation.quarantine_after).readmit(site_id)
        operator_record(settings.run_dir, "readmit", site=site_id)
    except (ConfigError, ValueError, AuditError) as exc:
        fail(str(exc), 2, exc)
    typer.echo(f"site {site_id} re-admitted (it was quarantined at step {entry.get('step', '?')} after {entry.get('refusals', '?')} refusals); it may join at once")


def stop(
    config: Optional[Path] = typer.Option(None, "--config", help="server TOML: its run_dir"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="the run folder itself, instead of --config"),
) -> None:
    """Stop the running coordinator cleanly: finish or abort the step, checkpoint, tell the sites.

    Sends SIGTERM to the coordinator of the run folder and waits until it has stopped."""
    try:
        folder = _run_dir(config, run_dir)
        typer.echo(stop_server(folder, before=lambda: operator_record(folder, "stop")))
    except (ConfigError, ValueError, AuditError) as exc:
        fail(str(exc), 1, exc)


def operator_record(run_dir: Path, command: str, **fields) -> None:
    """The operator's command in the coordinator's audit trail (``run_dir/audit.jsonl``), once
    the run folder exists (an enrolment before the first run is in the tokens file alone)."""
    import getpass

    if not Path(run_dir).is_dir():
        return
    AuditLog(Path(run_dir) / AUDIT_FILE).append("operator", command=command, user=getpass.getuser(), **fields)


def audit_verify(file: Path = typer.Argument(..., help="an audit.jsonl: a site's (state_dir/SITE_ID/audit.jsonl) or the coordinator's (in its run_dir)")) -> None:
    """Check an audit trail's hash chain and print what it records (what left the site, to whom, when)."""
    if not file.is_file():
        fail(f"{file}: no such audit file", 2)
    verified = verify_audit(file)
    for line in audit_summary(verified):
        typer.echo(line)
    if verified.broken:
        fail(f"{file}: the chain is broken: {verified.broken}; the {verified.lines} records before it are intact", 1)
    typer.echo(f"{file}: {verified.lines} records, chain intact; last hash {verified.last_hash} (note it elsewhere: it anchors every record up to here)")


def _run_dir(config: Path | None, run_dir: Path | None) -> Path:
    if (config is None) == (run_dir is None):
        raise ValueError("give the server config (--config server.toml) or the run folder (--run-dir), one of them")
    return run_dir if run_dir is not None else load_config(config, ServerConfig).run_dir
