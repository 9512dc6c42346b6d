"""What a pool is planned against: one enumeration of the machine's adapters (``ortq adapters``),
plus the devices of each plugin EP library its ``provider = "plugin"`` models name, listed the way
their workers will list them (ortq.devices.plugin_ep.open_library), and how each kind of provider
turns a ``[[model.workers]]`` adapter spec into one adapter, by the rules its workers apply."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ortq.devices.adapters import Adapter, select_adapter
from ortq.devices.enumeration import enumerate_adapters
from ortq.devices.plugin_ep import choose_plugin_adapter, open_library, resolve_webgpu
from ortq.errors import ConfigurationError
from ortq.pool.config import ModelConfig, PoolConfig

#: A plugin EP library and EP name (None: its only EP) -> that EP's devices.
PluginDevices = Mapping[tuple[str, str | None], Sequence[Adapter]]


def enumerate_for(config: PoolConfig) -> tuple[list[Adapter], list[str], dict[tuple[str, str | None], list[Adapter]]]:
    """The adapters and the enumeration's notes (``enumerate_adapters``), and each plugin library's
    devices; a library that cannot be registered is a ConfigurationError naming its model."""
    adapters, notes = enumerate_adapters()
    plugins: dict[tuple[str, str | None], list[Adapter]] = {}
    for model in config.models:
        if model.provider != "plugin" or model.ep_library is None:
            continue
        key = (model.ep_library, model.ep_name)
        if key not in plugins:
            import onnxruntime  # only a pool with plugin models needs it here

            try:
                _, _, plugins[key] = open_library(onnxruntime, str(model.ep_library), model.ep_name)
            except ConfigurationError as exc:  # ProviderUnavailable included
                raise type(exc)(f"{config.source}: [[model]] {model.name!r}: ep_library: {exc}") from None
    return adapters, notes, plugins


def candidates(model: ModelConfig, adapters: Sequence[Adapter], plugins: PluginDevices) -> list[Adapter]:
    """The adapters ``model``'s specs are resolved against: a plugin model sees its own library's
    devices as the ``plugin`` rows (another plugin model's library has its own)."""
    if model.provider != "plugin" or model.ep_library is None:
        return list(adapters)
    return [a for a in adapters if a.provider != "plugin"] + list(plugins.get((model.ep_library, model.ep_name), ()))


def choose(model: ModelConfig, spec: str | None, adapters: Sequence[Adapter]) -> Adapter:
    """The adapter ``spec`` (None: the provider's default) means for ``model``'s provider, as its
    worker decides: WebGPU by what Dawn's power preference reaches (a GPU none reaches is refused),
    a plugin EP's first non-CPU device by default, the others by ``select_adapter`` (default "0")."""
    if model.provider == "webgpu":
        return resolve_webgpu(spec, adapters)[0]
    if model.provider == "plugin":
        rows = [a for a in adapters if a.provider == "plugin"]
        return choose_plugin_adapter(spec, rows, model.ep_name or (rows[0].ep_name if rows else None) or "the EP")
    return select_adapter(spec or "0", adapters, model.provider)
