"""The kubelet node's container images, assembled here as OCI image archives (no base image is
fetched, no registry is asked): a layer tarball, a config and a manifest, stored by digest in an
image-layout tar that `ctr images import` takes as it is.

Reproducible: every timestamp is 0, every owner root, entries sorted and JSON canonical, and the
layer left uncompressed (so its digest is its diff_id and no gzip header carries a time), so the
same binaries give the same digests on every machine.

    archive = images.write(busybox_image(Path("/bin/busybox")), directory)
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = "docker.io/library/busybox:1.36"  # deploy/capabilities.example.yaml's `busybox:1.36`
PAUSE = "k8s-dispatch.invalid/pause:1"  # ours; `.invalid` is a name no resolver ever answers
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


class ImageBuildFailed(RuntimeError):
    """A program an image is made of is missing or would not list what it provides."""


@dataclass(frozen=True)
class Entry:
    """One file system entry of a layer: a directory, a regular file (data) or a symlink (target)."""

    path: str  # relative, no leading slash
    mode: int
    data: bytes | None = None
    target: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.data is None and self.target is None


@dataclass(frozen=True)
class Image:
    name: str  # fully qualified: what the kubelet asks for after normalising `busybox:1.36`
    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclass(frozen=True)
class Archive:
    name: str
    path: Path
    manifest_digest: str  # sha256:... what containerd reports as the image's digest


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, *, mode: int, kind: bytes = tarfile.REGTYPE, size: int = 0, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, target
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def layer(entries: tuple[Entry, ...]) -> bytes:
    """The layer tarball: parents before children, every directory an entry of its own."""
    paths = {e.path: e for e in entries}
    for e in entries:  # the parents an entry implies
        parts = e.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            paths.setdefault("/".join(parts[:i]), Entry("/".join(parts[:i]), 0o755))
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    for path in sorted(paths):
        e = paths[path]
        if e.is_dir:
            members.append((_info(path + "/", mode=e.mode, kind=tarfile.DIRTYPE), None))
        elif e.target is not None:
            members.append((_info(path, mode=e.mode, kind=tarfile.SYMTYPE, target=e.target), None))
        else:
            assert e.data is not None
            members.append((_info(path, mode=e.mode, size=len(e.data)), e.data))
    return _tar(members)


def _architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def archive_bytes(image: Image) -> tuple[bytes, str]:
    """The image-layout tar of `image` and its manifest's digest (pure: same image, same bytes)."""
    layer_blob = layer(image.entries)
    config = {
        "architecture": _architecture(),
        "os": "linux",
        "config": {
            "Env": [PATH_ENV],
            **({"Entrypoint": list(image.entrypoint)} if image.entrypoint else {}),
            **({"Cmd": list(image.cmd)} if image.cmd else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer_blob)]},
        "history": [{"created_by": "k8s-dispatch lab/realcluster/images.py"}],
    }
    config_blob = _canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": _digest(config_blob), "size": len(config_blob)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": _digest(layer_blob), "size": len(layer_blob)}],
    }
    manifest_blob = _canonical(manifest)
    manifest_digest = _digest(manifest_blob)
    tag = image.name.rsplit(":", 1)[1]
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_blob),
                "annotations": {"io.containerd.image.name": image.name, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    files: dict[str, bytes] = {
        "oci-layout": _canonical({"imageLayoutVersion": "1.0.0"}),
        "index.json": _canonical(index),
    }
    for blob in (layer_blob, config_blob, manifest_blob):
        files["blobs/sha256/" + _digest(blob).removeprefix("sha256:")] = blob
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (_info(d, mode=0o755, kind=tarfile.DIRTYPE), None) for d in ("blobs/", "blobs/sha256/")
    ]
    members += [(_info(name, mode=0o644, size=len(data)), data) for name, data in sorted(files.items())]
    return _tar(members), manifest_digest


def write(image: Image, directory: Path) -> Archive:
    """Write `image`'s archive into `directory` (named for the image) and say where."""
    data, digest = archive_bytes(image)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (image.name.rsplit("/", 1)[1].replace(":", "-") + ".oci.tar")
    path.write_bytes(data)
    return Archive(image.name, path, digest)


def _base() -> tuple[Entry, ...]:
    """What every image has besides its program: the mount points and a world-writable /tmp."""
    return (Entry("dev", 0o755), Entry("proc", 0o755), Entry("sys", 0o755), Entry("etc", 0o755), Entry("tmp", 0o1777))


def busybox_image(busybox: Path, *, name: str = BUSYBOX) -> Image:
    """busybox from Debian's busybox-static, with a symlink for each applet it lists (`sh`,
    `printf`, `cat`, `dd`, `sleep`, ...): what `busybox:1.36` gives a capability's script."""
    if not busybox.is_file():
        raise ImageBuildFailed(f"{busybox} is missing: install Debian's busybox-static (tools/build.sh containerd)")
    listed = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=False)
    if listed.returncode != 0 or not listed.stdout.strip():
        raise ImageBuildFailed(f"{busybox} --list-full failed: {listed.stderr.strip()}")
    applets = sorted({line.strip().lstrip("/") for line in listed.stdout.splitlines() if line.strip()})
    links = tuple(Entry(a, 0o777, target="/bin/busybox") for a in applets if a != "bin/busybox")
    entries = (*_base(), Entry("bin/busybox", 0o755, data=busybox.read_bytes()), *links)
    return Image(name, entries, cmd=("sh",))


def pause_image(pause: Path, *, name: str = PAUSE) -> Image:
    """The Pod sandbox's image: our static `pause` (tools/containerd/pause) and nothing else."""
    if not pause.is_file():
        raise ImageBuildFailed(f"{pause} is missing: build it with tools/build.sh containerd")
    return Image(name, (*_base(), Entry("pause", 0o755, data=pause.read_bytes())), entrypoint=("/pause",))


# --- images of several layers with a config of their own (the product's image: tools/image.py) ---


@dataclass(frozen=True)
class ImageConfig:
    """What an image's config says besides its layers: how its process runs, and its labels."""

    cmd: tuple[str, ...]
    env: tuple[str, ...]
    user: str = ""
    working_dir: str = ""
    exposed_ports: tuple[str, ...] = ()  # "5555/tcp"
    stop_signal: str = ""
    labels: tuple[tuple[str, str], ...] = ()


def _owned_info(
    name: str, *, mode: int, mtime: int, owner: tuple[int, int], kind: bytes = tarfile.REGTYPE, size: int = 0,
    target: str = "",
) -> tarfile.TarInfo:  # fmt: skip
    info = _info(name, mode=mode, kind=kind, size=size, target=target)
    info.mtime, (info.uid, info.gid) = mtime, owner
    return info


def layer_at(entries: tuple[Entry, ...], *, mtime: int, owners: dict[str, tuple[int, int]] | None = None) -> bytes:
    """`layer`, with every entry's time `mtime` (SOURCE_DATE_EPOCH) and the numeric owners `owners`
    names (path -> (uid, gid); root otherwise): nothing of the building host's users gets in."""
    owners = owners or {}
    paths = {e.path: e for e in entries}
    for e in entries:
        parts = e.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            paths.setdefault("/".join(parts[:i]), Entry("/".join(parts[:i]), 0o755))
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    for path in sorted(paths):
        e, owner = paths[path], owners.get(path, (0, 0))
        if e.is_dir:
            info = _owned_info(path + "/", mode=e.mode, mtime=mtime, owner=owner, kind=tarfile.DIRTYPE)
            members.append((info, None))
        elif e.target is not None:
            info = _owned_info(path, mode=e.mode, mtime=mtime, owner=owner, kind=tarfile.SYMTYPE, target=e.target)
            members.append((info, None))
        else:
            assert e.data is not None
            members.append((_owned_info(path, mode=e.mode, mtime=mtime, owner=owner, size=len(e.data)), e.data))
    return _tar(members)


def config_blob(layers: list[bytes], config: ImageConfig, *, created: str, history: list[str]) -> bytes:
    """The image config (canonical JSON) of `layers` (uncompressed: each digest is its diff_id)."""
    doc: dict[str, object] = {
        "architecture": _architecture(),
        "os": "linux",
        "created": created,
        "config": {
            "Env": list(config.env),
            "Cmd": list(config.cmd),
            **({"User": config.user} if config.user else {}),
            **({"WorkingDir": config.working_dir} if config.working_dir else {}),
            **({"ExposedPorts": {p: {} for p in config.exposed_ports}} if config.exposed_ports else {}),
            **({"StopSignal": config.stop_signal} if config.stop_signal else {}),
            **({"Labels": dict(config.labels)} if config.labels else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [_digest(blob) for blob in layers]},
        "history": [{"created": created, "created_by": h} for h in history],
    }
    return _canonical(doc)


def layout_archive(name: str, layers: list[bytes], config: bytes) -> tuple[bytes, str]:
    """The image-layout tar (what `ctr images import` takes) of an image `name` made of `layers` and
    `config`, and its manifest's digest (pure: same inputs, same bytes)."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": _digest(b), "size": len(b)} for b in layers],
    }
    manifest_blob = _canonical(manifest)
    manifest_digest = _digest(manifest_blob)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_blob),
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        ],
    }
    files: dict[str, bytes] = {
        "oci-layout": _canonical({"imageLayoutVersion": "1.0.0"}),
        "index.json": _canonical(index),
    }
    for blob in (*layers, config, manifest_blob):
        files["blobs/sha256/" + _digest(blob).removeprefix("sha256:")] = blob
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (_info(d, mode=0o755, kind=tarfile.DIRTYPE), None) for d in ("blobs/", "blobs/sha256/")
    ]
    members += [(_info(n, mode=0o644, size=len(data)), data) for n, data in sorted(files.items())]
    return _tar(members), manifest_digest
