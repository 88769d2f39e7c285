"""The node's images as our own code assembles them: a valid OCI image layout (every blob stored
under its own SHA-256, the manifest naming the config and the layer, the index naming the image),
reproducible to the byte, and busybox's applets present as links to the one binary."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from k8s_dispatch.lab.realcluster import images
from k8s_dispatch.lab.realcluster.images import Entry, Image

BUSYBOX = Path("/bin/busybox")


def _members(data: bytes) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: (m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()}  # type: ignore[union-attr]


def _layout(image: Image) -> tuple[dict, dict, dict, bytes]:
    """(index, manifest, config, layer) read back from the archive, every digest checked."""
    data, manifest_digest = images.archive_bytes(image)
    files = {name: body for name, (_, body) in _members(data).items() if body is not None}
    for name, body in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(body).hexdigest() == name.rsplit("/", 1)[1], name
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    [entry] = index["manifests"]
    assert entry["digest"] == manifest_digest
    manifest_blob = files["blobs/sha256/" + manifest_digest.removeprefix("sha256:")]
    assert entry["size"] == len(manifest_blob)
    manifest = json.loads(manifest_blob)
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:")])
    [layer_ref] = manifest["layers"]
    layer = files["blobs/sha256/" + layer_ref["digest"].removeprefix("sha256:")]
    assert config["rootfs"]["diff_ids"] == [layer_ref["digest"]]  # uncompressed: the digest is the diff_id
    return index, manifest, config, layer


def test_an_image_is_a_layout_containerd_can_import_named_as_the_kubelet_asks() -> None:
    image = Image("docker.io/library/x:1", (Entry("bin/x", 0o755, data=b"#!x"),), entrypoint=("/bin/x",))
    index, manifest, config, layer = _layout(image)
    assert index["manifests"][0]["annotations"] == {
        "io.containerd.image.name": "docker.io/library/x:1",
        "org.opencontainers.image.ref.name": "1",
    }
    assert manifest["mediaType"] == images.MEDIA_MANIFEST and manifest["layers"][0]["mediaType"] == images.MEDIA_LAYER
    assert (config["os"], config["config"]["Entrypoint"]) == ("linux", ["/bin/x"])
    members = _members(layer)
    assert list(members) == ["bin", "bin/x"] and members["bin"][0].isdir()  # the parent first, an entry of its own
    info, body = members["bin/x"]
    assert (body, info.mode, info.mtime, info.uid, info.gid, info.uname) == (b"#!x", 0o755, 0, 0, 0, "")


def test_the_same_inputs_give_the_same_digest_and_any_byte_changes_it() -> None:
    def make(data: bytes, name: str = "docker.io/library/x:1") -> str:
        return images.archive_bytes(Image(name, (Entry("x", 0o755, data=data), Entry("tmp", 0o1777))))[1]

    first = images.archive_bytes(Image("docker.io/library/x:1", (Entry("x", 0o755, data=b"a"), Entry("tmp", 0o1777))))
    again = images.archive_bytes(Image("docker.io/library/x:1", (Entry("tmp", 0o1777), Entry("x", 0o755, data=b"a"))))
    assert first == again  # the order entries are given in does not matter: bytes and digest are equal
    assert make(b"b") != make(b"a")
    # the name is the index's, not the manifest's: renaming keeps the digest, as a re-tag does
    assert make(b"a", "docker.io/library/y:2") == make(b"a")


def test_busybox_has_every_applet_the_echo_capability_uses_as_a_link_to_the_binary() -> None:
    image = images.busybox_image(BUSYBOX)
    assert image.name == "docker.io/library/busybox:1.36"
    _, _, config, layer = _layout(image)
    members = _members(layer)
    assert members["bin/busybox"][1] == BUSYBOX.read_bytes()
    links = {name: info.linkname for name, (info, _) in members.items() if info.issym()}
    for applet in ("bin/sh", "bin/cat", "bin/dd", "bin/sleep", "bin/echo", "usr/bin/printf"):
        assert links[applet] == "/bin/busybox", applet
    assert members["tmp"][0].mode == 0o1777
    assert "PATH=" in config["config"]["Env"][0] and config["config"]["Cmd"] == ["sh"]


def test_a_missing_program_is_a_typed_error_saying_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(images.ImageBuildFailed, match="busybox-static"):
        images.busybox_image(tmp_path / "busybox")
    with pytest.raises(images.ImageBuildFailed, match=r"tools/build\.sh containerd"):
        images.pause_image(tmp_path / "pause")
