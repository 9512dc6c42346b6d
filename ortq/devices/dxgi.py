"""DXGI adapter enumeration through ctypes (Windows only; no extra dependency).

The index ``EnumAdapters1`` gives an adapter is the ``device_id`` the DirectML provider
takes. ``IDXGIFactory6::EnumAdapterByGpuPreference`` gives the system's high-performance
and minimum-power orders, where Windows has it (1803+).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any

DXGI_ADAPTER_FLAG_SOFTWARE = 2
DXGI_ERROR_NOT_FOUND = 0x887A0002
DXGI_GPU_PREFERENCE_MINIMUM_POWER = 1
DXGI_GPU_PREFERENCE_HIGH_PERFORMANCE = 2

# COM vtable slots (IUnknown 0-2, IDXGIObject 3-6, IDXGIFactory 7-11, IDXGIFactory1 12-13, ...).
_RELEASE = 2
_ENUM_ADAPTERS1 = 12
_ENUM_ADAPTER_BY_GPU_PREFERENCE = 29
_GET_DESC1 = 10  # IDXGIAdapter1

_IID_FACTORY1 = "{770aae78-f26f-4dba-a829-253c83d1b387}"
_IID_FACTORY6 = "{c1b6694f-ff09-44a9-b03c-77900a0a1d17}"
_IID_ADAPTER1 = "{29038f61-3839-4626-91fd-086879011a05}"


@dataclass(frozen=True)
class DxgiAdapter:
    """One adapter as DXGI describes it."""

    index: int
    description: str
    vendor_id: int
    device_id: int
    dedicated_video_memory: int
    shared_system_memory: int
    luid: int  # HighPart << 32 | LowPart, as one unsigned 64-bit number
    software: bool


class _GUID(ctypes.Structure):
    _fields_ = [("data1", ctypes.c_uint32), ("data2", ctypes.c_uint16), ("data3", ctypes.c_uint16),
                ("data4", ctypes.c_ubyte * 8)]  # fmt: skip


class _LUID(ctypes.Structure):
    _fields_ = [("low", ctypes.c_uint32), ("high", ctypes.c_int32)]


class _AdapterDesc1(ctypes.Structure):
    _fields_ = [
        ("description", ctypes.c_wchar * 128),
        ("vendor_id", ctypes.c_uint),
        ("device_id", ctypes.c_uint),
        ("sub_sys_id", ctypes.c_uint),
        ("revision", ctypes.c_uint),
        ("dedicated_video_memory", ctypes.c_size_t),
        ("dedicated_system_memory", ctypes.c_size_t),
        ("shared_system_memory", ctypes.c_size_t),
        ("luid", _LUID),
        ("flags", ctypes.c_uint),
    ]


def _guid(text: str) -> _GUID:
    guid = _GUID()
    ole32: Any = ctypes.windll.ole32  # type: ignore[attr-defined]  # Windows only
    if ole32.CLSIDFromString(ctypes.c_wchar_p(text), ctypes.byref(guid)) != 0:
        raise OSError(f"bad GUID {text}")
    return guid


def _method(obj: ctypes.c_void_p, slot: int, *argtypes: Any) -> Any:
    """The COM method in ``slot`` of ``obj``'s vtable, bound to ``obj``."""
    vtable = ctypes.cast(obj, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))).contents
    prototype = ctypes.WINFUNCTYPE(ctypes.c_long, ctypes.c_void_p, *argtypes)  # type: ignore[attr-defined]
    function = prototype(vtable[slot])
    return lambda *args: function(obj, *args)


def _release(obj: ctypes.c_void_p) -> None:
    _method(obj, _RELEASE)()


def _describe(adapter: ctypes.c_void_p, index: int) -> DxgiAdapter:
    desc = _AdapterDesc1()
    hr = _method(adapter, _GET_DESC1, ctypes.POINTER(_AdapterDesc1))(ctypes.byref(desc))
    if hr != 0:
        raise OSError(f"IDXGIAdapter1::GetDesc1 failed: 0x{hr & 0xFFFFFFFF:08x}")
    return DxgiAdapter(
        index=index,
        description=desc.description,
        vendor_id=desc.vendor_id,
        device_id=desc.device_id,
        dedicated_video_memory=desc.dedicated_video_memory,
        shared_system_memory=desc.shared_system_memory,
        luid=((desc.luid.high & 0xFFFFFFFF) << 32) | desc.luid.low,
        software=bool(desc.flags & DXGI_ADAPTER_FLAG_SOFTWARE),
    )


def _factory() -> ctypes.c_void_p:
    dxgi: Any = ctypes.windll.dxgi  # type: ignore[attr-defined]  # Windows only
    factory = ctypes.c_void_p()
    hr = dxgi.CreateDXGIFactory1(ctypes.byref(_guid(_IID_FACTORY1)), ctypes.byref(factory))
    if hr != 0:
        raise OSError(f"CreateDXGIFactory1 failed: 0x{hr & 0xFFFFFFFF:08x}")
    return factory


def enumerate_dxgi() -> list[DxgiAdapter]:
    """Every adapter in DXGI's order (the DirectML device_id order). Raises OSError off Windows."""
    if sys.platform != "win32":
        raise OSError("DXGI exists only on Windows")
    factory = _factory()
    adapters: list[DxgiAdapter] = []
    try:
        enum = _method(factory, _ENUM_ADAPTERS1, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p))
        index = 0
        while True:
            adapter = ctypes.c_void_p()
            hr = enum(index, ctypes.byref(adapter))
            if hr & 0xFFFFFFFF == DXGI_ERROR_NOT_FOUND:
                break
            if hr != 0:
                raise OSError(f"IDXGIFactory1::EnumAdapters1({index}) failed: 0x{hr & 0xFFFFFFFF:08x}")
            try:
                adapters.append(_describe(adapter, index))
            finally:
                _release(adapter)
            index += 1
    finally:
        _release(factory)
    return adapters


def preference_order(preference: int) -> list[int] | None:
    """LUIDs in the system's order for ``preference``, or None where IDXGIFactory6 is missing."""
    if sys.platform != "win32":
        return None
    factory = _factory()
    try:
        factory6 = ctypes.c_void_p()
        query = _method(factory, 0, ctypes.POINTER(_GUID), ctypes.POINTER(ctypes.c_void_p))
        if query(ctypes.byref(_guid(_IID_FACTORY6)), ctypes.byref(factory6)) != 0:
            return None
        try:
            enum = _method(factory6, _ENUM_ADAPTER_BY_GPU_PREFERENCE, ctypes.c_uint, ctypes.c_int,
                           ctypes.POINTER(_GUID), ctypes.POINTER(ctypes.c_void_p))  # fmt: skip
            iid = _guid(_IID_ADAPTER1)
            order: list[int] = []
            while True:
                adapter = ctypes.c_void_p()
                hr = enum(len(order), preference, ctypes.byref(iid), ctypes.byref(adapter))
                if hr != 0:
                    break
                try:
                    order.append(_describe(adapter, len(order)).luid)
                finally:
                    _release(adapter)
            return order
        finally:
            _release(factory6)
    finally:
        _release(factory)
