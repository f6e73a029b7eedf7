"""cdi/: the spec model, minimum version, schema validation, atomic writes, file naming."""

from __future__ import annotations

import filecmp
import json
import os
import stat
from pathlib import Path

import pytest

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    Mount,
    SchemaError,
    Spec,
    SpecError,
    SpecWriter,
    validate,
)
from cdi.spec import transient_spec_name, transient_spec_uid
from cdi.writer import is_write_leftover

REPO = Path(__file__).resolve().parents[2]
VENDORED = REPO / "cdi" / "schema"
REFERENCE = Path("/work/shared/reference/cdi-schema")
KIND = "k8s.vgpu.sharing.dev/claim"


def spec(edits: ContainerEdits | None = None, name: str = "dev", **kw: object) -> Spec:
    edits = edits or ContainerEdits()
    return Spec(kind=KIND, devices=(Device(name=name, edits=edits),), **kw)  # type: ignore[arg-type]


def test_vendored_schema_identical_to_reference() -> None:
    if not REFERENCE.is_dir():
        pytest.skip(f"reference copy {REFERENCE} absent: nothing to compare the vendored copy to")
    for name in ("schema.json", "defs.json"):
        assert filecmp.cmp(VENDORED / name, REFERENCE / name, shallow=False), name
    assert "Apache" in (VENDORED / "SOURCE.md").read_text()


def test_official_testdata() -> None:
    if not REFERENCE.is_dir():
        pytest.skip(f"reference test data {REFERENCE}/testdata absent")
    for good in sorted((REFERENCE / "testdata" / "good").glob("*.json")):
        validate(json.loads(good.read_text()))
    with pytest.raises(SchemaError, match="'cdiVersion' is a required property"):
        validate(json.loads((REFERENCE / "testdata" / "bad" / "explicit-empty.json").read_text()))


@pytest.mark.parametrize(
    ("edits", "name", "kw", "version"),
    [
        (ContainerEdits(env=(("A", "1"),)), "dev", {}, "0.3.0"),
        (ContainerEdits(mounts=(Mount("/a", "/b", ("ro", "bind")),)), "dev", {}, "0.3.0"),
        (ContainerEdits(device_nodes=(DeviceNode("/dev/x"),)), "dev", {}, "0.3.0"),
        (ContainerEdits(hooks=(Hook("createContainer", "/bin/true"),)), "dev", {}, "0.3.0"),
        (ContainerEdits(mounts=(Mount("/a", "/b", type="bind"),)), "dev", {}, "0.4.0"),
        (ContainerEdits(device_nodes=(DeviceNode("/dev/x", "/h/x"),)), "dev", {}, "0.5.0"),
        (ContainerEdits(env=(("A", "1"),)), "0c4e-uid", {}, "0.5.0"),
        (ContainerEdits(env=(("A", "1"),)), "dev", {"annotations": {"a": "b"}}, "0.6.0"),
    ],
)
def test_minimum_version(
    edits: ContainerEdits, name: str, kw: dict[str, object], version: str
) -> None:
    s = spec(edits, name, **kw)
    assert s.minimum_version() == version
    doc = s.to_dict()
    assert doc["cdiVersion"] == version
    validate(doc)


def test_device_annotations_and_dotted_class_need_060() -> None:
    dev = Device(name="d", edits=ContainerEdits(env=(("A", "1"),)), annotations={"x": "y"})
    assert Spec(kind=KIND, devices=(dev,)).minimum_version() == "0.6.0"
    plain = Device(name="d", edits=ContainerEdits(env=(("A", "1"),)))
    assert Spec(kind="vendor.com/gpu.slice", devices=(plain,)).minimum_version() == "0.6.0"


def test_to_dict_shape() -> None:
    s = spec(
        ContainerEdits(
            env=(("CUDA_VISIBLE_DEVICES", "GPU-1"),),
            device_nodes=(DeviceNode("/dev/nvidia0", "/dev/nvidia0"),),
            mounts=(Mount("/h/lib.so", "/c/lib.so", ("ro", "bind")),),
        ),
        name="uid-1",
    )
    assert s.to_dict() == {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": [
            {
                "name": "uid-1",
                "containerEdits": {
                    "env": ["CUDA_VISIBLE_DEVICES=GPU-1"],
                    "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}],
                    "mounts": [
                        {
                            "hostPath": "/h/lib.so",
                            "containerPath": "/c/lib.so",
                            "options": ["ro", "bind"],
                        }
                    ],
                },
            }
        ],
    }
    assert s.qualified_name("uid-1") == f"{KIND}=uid-1"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Spec(kind="novendor", devices=(Device("d", ContainerEdits()),)), "exactly one '/'"),
        (Spec(kind="v_x/c", devices=(Device("d", ContainerEdits()),)), "vendor 'v_x'"),
        (Spec(kind=KIND, devices=()), "at least one device"),
        (Spec(kind=KIND, devices=(Device("-d", ContainerEdits()),)), "device '-d'"),
        (
            Spec(kind=KIND, devices=(Device("d", ContainerEdits()), Device("d", ContainerEdits()))),
            "appears twice",
        ),
        (spec(ContainerEdits(env=(("1BAD", "x"),))), "env name '1BAD'"),
        (spec(ContainerEdits(mounts=(Mount("rel", "/c"),))), "mount path 'rel'"),
        (spec(ContainerEdits(device_nodes=(DeviceNode("dev/x"),))), "not absolute"),
        (spec(ContainerEdits(hooks=(Hook("whenever", "/x"),))), "hook 'whenever' unknown"),
    ],
)
def test_check_rejects(bad: Spec, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        bad.check()


def test_validate_rejects() -> None:
    with pytest.raises(SchemaError, match="at devices/0: 'containerEdits' is a required"):
        validate({"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "x"}]})
    with pytest.raises(SchemaError, match=r"cdiVersion '9\.9\.9' unknown"):
        validate({"cdiVersion": "9.9.9", "kind": KIND, "devices": []})
    with pytest.raises(SchemaError, match="env entry 'NOEQUALS'"):
        validate(
            {
                "cdiVersion": "0.5.0",
                "kind": KIND,
                "devices": [{"name": "x", "containerEdits": {"env": ["NOEQUALS"]}}],
            }
        )
    with pytest.raises(SchemaError, match="mounts/0: 'containerPath' is a required"):
        validate(
            {
                "cdiVersion": "0.5.0",
                "kind": KIND,
                "devices": [{"name": "x", "containerEdits": {"mounts": [{"hostPath": "/a"}]}}],
            }
        )


def test_transient_file_name() -> None:
    uid = "0c4e7a3e-1111-4222-8333-444455556666"
    assert transient_spec_name(KIND, uid) == f"k8s.vgpu.sharing.dev-claim_{uid}.json"
    assert transient_spec_uid(KIND, transient_spec_name(KIND, uid)) == uid
    for other in (f"k8s.vgpu.sharing.dev-claim_{uid}.yaml", f"k8s.other-claim_{uid}.json",
                  f".k8s.vgpu.sharing.dev-claim_{uid}.json.0a1b2c.tmp"):  # fmt: skip
        assert transient_spec_uid(KIND, other) is None


def test_write_leftovers_are_the_writers_temporary_files_only(tmp_path: Path) -> None:
    w = SpecWriter(tmp_path)
    w.write(spec(ContainerEdits(env=(("A", "1"),)), name="u1"), "u1")
    name = transient_spec_name(KIND, "u1")
    assert not is_write_leftover(KIND, name)
    assert is_write_leftover(KIND, f".{name}.0a1b2c3d4e5f.tmp")
    assert not is_write_leftover(KIND, ".k8s.other-claim_u1.json.0a1b2c3d4e5f.tmp")


def test_writer_removes_a_link_in_place_of_a_spec_as_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    w = SpecWriter(tmp_path / "cdi")
    w.cdi_root.mkdir()
    w.path_for(KIND, "u1").symlink_to(victim)
    assert w.remove(KIND, "u1") is True
    assert list(w.cdi_root.iterdir()) == [] and victim.read_text() == "keep"


def test_writer_atomic_write_and_remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cdi"
    w = SpecWriter(root)
    s1 = spec(ContainerEdits(env=(("A", "1"),)), name="u1")
    path = w.write(s1, "u1")
    assert path == root / "k8s.vgpu.sharing.dev-claim_u1.json"
    assert json.loads(path.read_text()) == s1.to_dict()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644

    # A failure before the rename leaves the old file whole and no temporary behind.
    def boom(*_: object, **__: object) -> None:
        raise OSError("no space left")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="no space left"):
        w.write(spec(ContainerEdits(env=(("A", "2"),)), name="u1"), "u1")
    monkeypatch.undo()
    assert json.loads(path.read_text()) == s1.to_dict()
    assert [p.name for p in root.iterdir()] == [path.name]

    assert w.remove(KIND, "u1") is True
    assert w.remove(KIND, "u1") is False
    assert list(root.iterdir()) == []


def test_writer_refuses_invalid_spec(tmp_path: Path) -> None:
    w = SpecWriter(tmp_path)
    with pytest.raises(SpecError):
        w.write(spec(ContainerEdits(env=(("BAD-NAME", "1"),))), "u1")
    assert list(tmp_path.iterdir()) == []
