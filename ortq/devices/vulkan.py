"""Vulkan physical devices through ctypes (the loader ``libvulkan.so.1``; no extra dependency).

On Linux the WebGPU execution provider runs on Dawn's Vulkan backend, and ONNX Runtime's own
device list there comes from ``/sys/class/drm`` (no names, and nothing for a software driver
such as Mesa's lavapipe or a GPU in a VM without DRM). This module asks the Vulkan loader what
Dawn will see: each physical device's name, type, vendor and device ids, UUID, and its largest
device-local memory heap. It is the WebGPU counterpart of ``dxgi.py``.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from dataclasses import dataclass
from typing import Any

#: The loader's file name on each system Dawn uses Vulkan on.
LOADER = {"linux": "libvulkan.so.1", "win32": "vulkan-1.dll"}

# VkPhysicalDeviceType: OTHER, INTEGRATED_GPU, DISCRETE_GPU, VIRTUAL_GPU, CPU.
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

_VK_SUCCESS = 0
_VK_INCOMPLETE = 5
_STYPE_APPLICATION_INFO = 0
_STYPE_INSTANCE_CREATE_INFO = 1
_STYPE_PROPERTIES_2 = 1000059001
_STYPE_ID_PROPERTIES = 1000071004
_API_VERSION_1_1 = (1 << 22) | (1 << 12)
_MEMORY_HEAP_DEVICE_LOCAL = 1
_PROPERTIES_BYTES = 4096  # VkPhysicalDeviceProperties is 824 bytes; room to spare
_NAME_OFFSET = 20  # after apiVersion, driverVersion, vendorID, deviceID, deviceType
_NAME_BYTES = 256


@dataclass(frozen=True)
class VulkanDevice:
    """One physical device as the Vulkan loader describes it."""

    index: int  # position in vkEnumeratePhysicalDevices' order
    name: str
    device_type: str  # one of DEVICE_TYPES' values
    vendor_id: int
    device_id: int
    uuid: str  # deviceUUID, 8-4-4-4-12 hex
    memory_bytes: int  # the largest device-local heap
    api_version: str


class _ApplicationInfo(ctypes.Structure):
    _fields_ = [("s_type", ctypes.c_int), ("p_next", ctypes.c_void_p), ("application", ctypes.c_char_p),
                ("application_version", ctypes.c_uint32), ("engine", ctypes.c_char_p),
                ("engine_version", ctypes.c_uint32), ("api_version", ctypes.c_uint32)]  # fmt: skip


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("s_type", ctypes.c_int), ("p_next", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("application_info", ctypes.POINTER(_ApplicationInfo)), ("layer_count", ctypes.c_uint32),
                ("layers", ctypes.c_void_p), ("extension_count", ctypes.c_uint32),
                ("extensions", ctypes.c_void_p)]  # fmt: skip


class _IdProperties(ctypes.Structure):
    _fields_ = [("s_type", ctypes.c_int), ("p_next", ctypes.c_void_p), ("device_uuid", ctypes.c_ubyte * 16),
                ("driver_uuid", ctypes.c_ubyte * 16), ("device_luid", ctypes.c_ubyte * 8),
                ("node_mask", ctypes.c_uint32), ("luid_valid", ctypes.c_uint32)]  # fmt: skip


class _Properties2(ctypes.Structure):
    _fields_ = [("s_type", ctypes.c_int), ("p_next", ctypes.c_void_p),
                ("properties", ctypes.c_ubyte * _PROPERTIES_BYTES)]  # fmt: skip


def load_loader() -> Any:
    """The Vulkan loader library; OSError naming the file when it cannot be loaded."""
    name = LOADER.get(sys.platform)
    if name is None:
        raise OSError(f"no Vulkan loader on {sys.platform} (WebGPU there does not go through Vulkan)")
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        raise OSError(f"the Vulkan loader {name} could not be loaded ({exc})") from exc


def format_uuid(raw: bytes) -> str:
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _version(value: int) -> str:
    return f"{(value >> 22) & 0x7F}.{(value >> 12) & 0x3FF}.{value & 0xFFF}"


def _describe(vk: Any, handle: ctypes.c_void_p, index: int) -> VulkanDevice:
    ids = _IdProperties(s_type=_STYPE_ID_PROPERTIES)
    properties = _Properties2(s_type=_STYPE_PROPERTIES_2, p_next=ctypes.cast(ctypes.pointer(ids), ctypes.c_void_p))
    vk.vkGetPhysicalDeviceProperties2(handle, ctypes.byref(properties))
    raw = bytes(properties.properties)
    api_version, _, vendor_id, device_id, device_type = struct.unpack_from("<5I", raw, 0)
    name = raw[_NAME_OFFSET : _NAME_OFFSET + _NAME_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace")
    # VkPhysicalDeviceMemoryProperties: a count and 32 (flags, heap) types, then a count and 16
    # (size, flags) heaps from offset 264.
    memory = (ctypes.c_ubyte * 520)()
    vk.vkGetPhysicalDeviceMemoryProperties(handle, ctypes.byref(memory))
    heaps = bytes(memory)
    (heap_count,) = struct.unpack_from("<I", heaps, 260)
    device_local = [
        size
        for size, flags in (struct.unpack_from("<QI", heaps, 264 + 16 * i) for i in range(min(heap_count, 16)))
        if flags & _MEMORY_HEAP_DEVICE_LOCAL
    ]
    return VulkanDevice(
        index=index,
        name=name,
        device_type=DEVICE_TYPES.get(device_type, "other"),
        vendor_id=vendor_id,
        device_id=device_id,
        uuid=format_uuid(bytes(ids.device_uuid)),
        memory_bytes=max(device_local, default=0),
        api_version=_version(api_version),
    )


def enumerate_vulkan() -> list[VulkanDevice]:
    """Every physical device the loader's drivers offer, in its order. Raises OSError when the
    loader cannot be loaded or an instance cannot be created (an empty list: no driver)."""
    vk = load_loader()
    vk.vkCreateInstance.restype = ctypes.c_int
    vk.vkEnumeratePhysicalDevices.restype = ctypes.c_int
    vk.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]
    vk.vkGetPhysicalDeviceProperties2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    vk.vkGetPhysicalDeviceMemoryProperties.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    vk.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    application = _ApplicationInfo(s_type=_STYPE_APPLICATION_INFO, application=b"ortq", api_version=_API_VERSION_1_1)
    create = _InstanceCreateInfo(s_type=_STYPE_INSTANCE_CREATE_INFO, application_info=ctypes.pointer(application))
    instance = ctypes.c_void_p()
    result = vk.vkCreateInstance(ctypes.byref(create), None, ctypes.byref(instance))
    if result == -9:  # VK_ERROR_INCOMPATIBLE_DRIVER: the loader found no driver at all
        return []
    if result != _VK_SUCCESS:
        raise OSError(f"vkCreateInstance failed with VkResult {result}")
    try:
        count = ctypes.c_uint32(0)
        result = vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        if result not in (_VK_SUCCESS, _VK_INCOMPLETE):
            raise OSError(f"vkEnumeratePhysicalDevices failed with VkResult {result}")
        handles = (ctypes.c_void_p * count.value)()
        result = vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        if result not in (_VK_SUCCESS, _VK_INCOMPLETE):
            raise OSError(f"vkEnumeratePhysicalDevices failed with VkResult {result}")
        return [_describe(vk, ctypes.c_void_p(handles[i]), i) for i in range(count.value)]
    finally:
        vk.vkDestroyInstance(instance, None)
