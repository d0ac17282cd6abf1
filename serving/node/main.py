"""Entry point of the built-in serving node.

Start-up order: wait for the database and upgrade it; load the engine from ``model.path`` (a local
model directory; ``flywheel node`` fills an empty one with the demo's tiny model, and an empty one
here is an error that names the setting); name its weights with a registered version — on a fresh
registry the base model is published as version 0 (full) and marked stable, so every generation
this node serves names a registered version; otherwise follow the stable version before accepting
traffic (and preload a canary version, if any). Then serve until stopped, with the updater polling.
The engine keeps the last ``node.keep_versions`` versions.

The node announces itself (its live heartbeat and its row in ``nodes``, which tell the gateway
where to send requests) only once its HTTP port listens and it holds a loaded version
(:func:`announce_when_listening`): a gateway never routes to a node that would refuse the
connection.

With ``node.engine = "vllm"``, :func:`run_vllm` keeps a vLLM server on the registry's versions, as
full weights or as LoRA adapters (``node.vllm_mode``). In full mode the process also serves the
front (``serving/node/vllm_front.py``) that the gateway reaches: vLLM's answers stamped with the
version that produced them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from flywheel.settings import Settings

log = logging.getLogger(__name__)


def bootstrap_version(engine, registry) -> None:  # type: ignore[no-untyped-def]
    """Give the engine's start-up weights a registered version (publishing version 0 if none)."""
    if registry.latest() is None:
        info = registry.ensure_base(engine.state(), reason="node bootstrap: base model")
        log.info("published the base model as version %d (%s)", info.version, info.sha256[:12])
    for info in registry.versions():
        if info.sha256 == engine.sha256:
            engine.set_version(info.version)
            return


def announce_when_listening(updater: Any, listening: threading.Event, done: threading.Event) -> threading.Thread:
    """A thread that calls ``updater.announce()`` once ``listening`` is set (the server started),
    unless ``done`` is set first (the server stopped before it ever listened)."""

    def wait() -> None:
        while not listening.wait(0.05):
            if done.is_set():
                return
        updater.announce()

    thread = threading.Thread(target=wait, name="node-announce", daemon=True)
    thread.start()
    return thread


def _open(settings: Settings, cleanup: contextlib.ExitStack) -> tuple[Any, Any, Any]:
    """The database's session factory, the line's registry and the live state, closed by ``cleanup``."""
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.live import make_live
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    db = open_database(settings.database_url, settings.db.wait_s)
    cleanup.callback(db.dispose)
    sessions = make_session_factory(db)
    registry = Registry(sessions, make_store(settings), settings.model.line, full_every=settings.trainer.full_every)
    live = make_live(settings)
    cleanup.callback(live.close)
    return sessions, registry, live


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Serve the node on ``settings.node.host:port`` until ``stop`` is set (or SIGINT/SIGTERM)."""
    if settings.node.engine == "vllm":
        run_vllm(settings, stop)
        return
    model_path = settings.model.local_dir()  # before anything starts: an empty model.path is an error
    import torch

    from serving.node.app import create_app
    from serving.node.engine import Engine
    from serving.node.updater import Updater, node_url
    from serving.server import serve

    torch.set_num_threads(settings.torch_threads)
    with contextlib.ExitStack() as cleanup:
        sessions, registry, live = _open(settings, cleanup)

        engine = Engine(model_path, settings)
        cleanup.callback(engine.close)
        bootstrap_version(engine, registry)
        url = node_url(settings)
        updater = Updater(engine, registry, settings, session_factory=sessions, live=live, url=url, announce=False)
        outcome = updater.check_once()
        if engine.version is None:
            raise RuntimeError(f"no registered version could be loaded at start-up: {outcome.detail or 'none matches'}")
        updater.start()
        cleanup.callback(updater.stop)

        app = create_app(engine, updater, settings)
        listening, done = threading.Event(), threading.Event()
        cleanup.callback(done.set)
        announce_when_listening(updater, listening, done)
        log.info("node %s serving %s v%s on %s", settings.node.node_id, settings.model.line, engine.version, url)
        serve(app, host=settings.node.host, port=settings.node.port, stop=stop, ready=listening,
              log_level=settings.log_level)


def run_vllm(settings: Settings, stop: threading.Event | None = None) -> None:
    """Keep the vLLM server at ``node.vllm_url`` on the registry's stable version until ``stop``.

    vLLM generates; this process follows the registry through a
    :class:`~serving.node.vllm_adapter.VllmAdapter`, exactly as the built-in node follows it through
    its engine, in the mode ``node.vllm_mode`` names:

    - ``full``: it names the weights vLLM started from with their registry version (publishing
      them as version 0 on an empty registry), waits for vLLM to answer, then reloads each new
      stable version in place. It serves the front on ``node.host:node.port`` (the URL its
      heartbeat carries, so the gateway sends requests there): requests are forwarded to vLLM and
      stamped with the live version, which a reload cannot change while one is in flight
      (:class:`~serving.node.vllm_front.VersionGate`).
    - ``lora``: vLLM serves the fixed base model ``model.path``; every version is a LoRA adapter
      (``trainer.lora_*`` describe them), loaded at runtime and served as ``<line>-v<version>``,
      with the canary preloaded. On an empty registry it publishes the zero adapter as version 0.
      It waits for vLLM to answer, then must get the stable version loaded before it carries on
      (else it raises, as the built-in node does); the heartbeat carries ``node.vllm_url`` and
      ``model_names``, which tell the gateway which ``model`` to send vLLM for each version.

    In both modes, once vLLM answers, the node refuses to go on against a vLLM that returns raw
    logprobs (serving/node/vllm_probe.py: start it with ``--logprobs-mode processed_logprobs``).
    Every call to vLLM carries ``node.vllm_api_key`` as a bearer token when it is set."""
    if settings.node.vllm_mode == "lora":
        _run_vllm_lora(settings, stop or threading.Event())
        return
    from flywheel.weights.codec.state import decode_full
    from flywheel.weights.codec.tensorfile import weight_files
    from flywheel.weights.files import files_digest
    from serving.node.updater import Updater, node_url
    from serving.node.vllm_adapter import VllmAdapter
    from serving.node.vllm_front import VersionGate, create_front
    from serving.server import bind, serve

    base_path = settings.model.local_dir()  # the folder vLLM was started from
    stop = stop or threading.Event()
    with contextlib.ExitStack() as cleanup:
        sessions, registry, live = _open(settings, cleanup)

        files = weight_files(base_path)  # the folder vLLM was started from
        digest = files_digest(files)  # read tensor by tensor: the node never holds the model
        if registry.latest() is None:  # the line's first version: published once, from a whole state
            base_state: dict = {}
            for shard in files:
                base_state.update(decode_full(shard.read_bytes()))
            registry.ensure_base(base_state, reason="vllm node bootstrap: base model")
            del base_state
        sha = digest[0]
        base = next((info for info in registry.versions() if info.sha256 == sha), None)
        if base is None:
            raise RuntimeError(f"the weights in {base_path} are no registered version of {settings.model.line}")
        work_dir = settings.node.vllm_work_dir or str(settings.data_path / "vllm")
        gate = VersionGate()
        adapter = VllmAdapter(settings.node.vllm_url, registry, work_dir, mode="full",
                              served_model_name=settings.model.line, base_version=base.version,
                              base_path=base_path, base_digest=digest, gate=gate,
                              api_key=settings.node.vllm_api_key)
        cleanup.callback(adapter.close)
        if not adapter.wait_ready(stop):
            return
        adapter.check_logprobs_mode()  # refuses raw logprobs before anything is served
        adapter.prepare()  # weight-version labels (vLLM 0.33), the start-up weights labelled
        # Bound now, so a port that is taken fails before the updater starts; the heartbeat names
        # this URL only once the front serves on it (announce_when_listening).
        sock = bind(settings.node.host, settings.node.port)
        cleanup.callback(sock.close)
        url = node_url(settings)
        updater = Updater(adapter, registry, settings, session_factory=sessions, live=live, url=url, announce=False)
        updater.check_once()
        updater.start()
        cleanup.callback(updater.stop)
        app = create_front(adapter, gate, settings, updater)
        listening, done = threading.Event(), threading.Event()
        cleanup.callback(done.set)
        announce_when_listening(updater, listening, done)  # the front serves: the heartbeat may name it
        log.info("node %s serves %s v%s from vLLM at %s on %s", settings.node.node_id, settings.model.line,
                 adapter.current()[0], settings.node.vllm_url, url)
        serve(app, host=settings.node.host, port=settings.node.port, stop=stop, sock=sock, ready=listening,
              log_level=settings.log_level)


def _run_vllm_lora(settings: Settings, stop: threading.Event) -> None:
    """``run_vllm`` in LoRA mode (see there)."""
    lora = settings.trainer
    if lora.lora_rank == 0:
        raise RuntimeError("node.vllm_mode = 'lora' needs the line's LoRA settings: trainer.lora_rank > 0 "
                           "(with trainer.lora_alpha and trainer.lora_targets as the trainer publishes them)")
    from serving.node.updater import Updater
    from serving.node.vllm_adapter import VllmAdapter
    from serving.node.vllm_files import zero_adapter_state

    with contextlib.ExitStack() as cleanup:
        sessions, registry, live = _open(settings, cleanup)
        if registry.latest() is None:
            base_path = settings.model.local_dir()
            zero = zero_adapter_state(base_path, lora.lora_rank, lora.lora_targets, seed=lora.seed)
            info = registry.ensure_base(zero, reason=f"vllm node bootstrap: zero LoRA adapter on {base_path}")
            log.info("published the zero LoRA adapter as version %d (%s)", info.version, info.sha256[:12])
        lora_config = {"r": lora.lora_rank, "lora_alpha": lora.lora_alpha, "target_modules": list(lora.lora_targets)}
        work_dir = settings.node.vllm_work_dir or str(settings.data_path / "vllm")
        adapter = VllmAdapter(settings.node.vllm_url, registry, work_dir, mode="lora",
                              keep_versions=settings.node.keep_versions, lora_config=lora_config,
                              api_key=settings.node.vllm_api_key)
        cleanup.callback(adapter.close)
        if not adapter.wait_ready(stop):
            return
        adapter.check_logprobs_mode()  # refuses raw logprobs before anything is loaded
        updater = Updater(adapter, registry, settings, session_factory=sessions, live=live,
                          url=settings.node.vllm_url, announce=False)
        outcome = updater.check_once()
        if adapter.current()[0] is None:
            raise RuntimeError("no registered version could be loaded into vLLM at start-up: "
                               f"{outcome.detail or 'none is stable'}")
        if strays := adapter.unload_strays():
            log.info("unloaded LoRA adapters an earlier node process left in vLLM: %s", ", ".join(strays))
        updater.announce()  # vLLM answers and holds the stable version: the heartbeat may name it
        updater.start()
        cleanup.callback(updater.stop)
        log.info("node %s keeps vLLM at %s on %s v%s (LoRA adapters %s)", settings.node.node_id,
                 settings.node.vllm_url, settings.model.line, adapter.current()[0], adapter.model_names())
        stop.wait()
