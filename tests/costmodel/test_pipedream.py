"""Import of PipeDream graph.txt profiles: parsing, preprocessing, malformed files."""
from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ProfileFormatError
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)
BATCH = {"vgg16": 128, "resnet50": 128, "resnext50": 128, "inception_v3": 128,
         "nasnetamobile": 128, "resnet101": 64, "resnext101": 64, "densenet121": 64,
         "alexnet": 256, "resnet18": 256, "squeezenet1_0": 256, "nasnetalarge": 16,
         "gnmt": None, "gnmt_large": None}

TINY = """node1 -- Input -- forward_compute_time=10.0, backward_compute_time=0.000, activation_size=77070336.0, parameter_size=0.000
node3 -- LSTM(2, 2) -- forward_compute_time=2.0, backward_compute_time=4.0, activation_size=[100.0; 20.0], parameter_size=8.0
node2 -- Conv2d(3, 8) -- forward_compute_time=1.5, backward_compute_time=2.5, activation_size=1000.0, parameter_size=64.0
node4 -- __getitem__(0) -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000
node5 -- __getitem__(1) -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=20.0, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
\tnode3 -- node5
\tnode4 -- node6
node6 -- Linear(2, 2) -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=8.0, parameter_size=24.0
"""


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "graph.txt"
    f.write_text(text)
    return f


def test_tiny(tmp_path: Path) -> None:
    p = Profile.from_pipedream(write(tmp_path, TINY))
    assert p.names == ["node1", "node2", "node3", "node4", "node6"]  # node5: unused getitem sink
    n1, n2, n3 = p.nodes[:3]
    assert (n1.forward_s, n1.activation_bytes, n1.op) == (0.0, 0.0, "placeholder")
    assert n2.forward_s == 1.5 / 1000 and n2.backward_s == 2.5 / 1000
    assert n3.activation_bytes == 120.0 and not n3.sendable
    assert p.nodes[3].inputs == ("node3",) and p.batch_size == 128  # 128 x 3x224x224x4 bytes
    # PipeDream's profiles have no optimizer-step time: the update stays out (0)
    assert all(n.update_s == 0.0 for n in p.nodes) and n2.compute_s == (1.5 + 2.5) / 1000


@pytest.mark.parametrize("text,what", [
    ("node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=1.0\n",
     "missing field"),
    ("node1 -- X -- forward_compute_time=abc, backward_compute_time=0.0, activation_size=1.0, "
     "parameter_size=0\n", "bad number"),
    ("node1 -- X -- forward_compute_time=1, backward_compute_time=0.0, activation_size=1.0, "
     "parameter_size=0\n\tnode1 -- node9\n", "unknown node"),
    ("node1 -- X -- forward_compute_time=1, backward_compute_time=0, activation_size=1, parameter_size=0\n"
     "node2 -- Y -- forward_compute_time=1, backward_compute_time=0, activation_size=1, parameter_size=0\n"
     "\tnode1 -- node2\n\tnode2 -- node1\n", "cycle"),
    ("just some text\n", "expected"),
])
def test_malformed(tmp_path: Path, text: str, what: str) -> None:
    f = write(tmp_path, text)
    with pytest.raises(ProfileFormatError) as ei:
        Profile.from_pipedream(f)
    msg = str(ei.value)
    assert what in msg and "graph.txt" in msg
    if what != "cycle":
        assert ":1:" in msg or ":3:" in msg or ":2:" in msg


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match="does not exist"):
        Profile.from_pipedream(tmp_path / "nope" / "graph.txt")


@pytest.mark.parametrize("model", sorted(BATCH))
def test_real_profiles(model: str) -> None:
    p = Profile.from_pipedream(PROFILES / model / "graph.txt")
    assert p.batch_size == BATCH[model]
    assert all(n.forward_s == 0 and n.activation_bytes == 0 for n in p.nodes if n.op == "placeholder")
    assert not any(n.target.startswith("__getitem__") and not any(n.name in m.inputs for m in p.nodes)
                   for n in p.nodes)
    assert p.total_compute_s > 0
