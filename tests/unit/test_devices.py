"""orchestrator.core.devices: the docker flags to the exact argv, and the AMD render-node probe and its
parsers on KFD topologies recorded from real machines."""

import shlex
import subprocess

import pytest

from orchestrator.core.devices import (
    AMD_PROBE,
    KFD_NODES,
    amd_device_args,
    nvidia_device_args,
    parse_amd_render,
    parse_kfd_properties,
)

# Recorded KFD topologies, in `grep -H` form (path:line), trimmed to the lines that matter. Each is a
# copy of /sys/class/kfd/kfd/topology taken from a real machine, from the testdata of
# https://github.com/ROCm/k8s-device-plugin (commit ed7646843003e8f0b6a0630346f01bb4d1ecff2e).

# testdata/topology-parsing/topology/nodes/{0,1,2}/{gpu_id,properties} (added in a4de4a44):
# one CPU node, then two GPUs.
TWO_GPUS = """\
nodes/0/gpu_id:0
nodes/0/properties:cpu_cores_count 20
nodes/0/properties:simd_count 0
nodes/0/properties:drm_render_minor 0
nodes/0/properties:max_engine_clk_ccompute 3200
nodes/1/gpu_id:13261
nodes/1/properties:cpu_cores_count 0
nodes/1/properties:simd_count 256
nodes/1/properties:drm_render_minor 128
nodes/1/properties:max_engine_clk_ccompute 3200
nodes/2/gpu_id:13261
nodes/2/properties:cpu_cores_count 0
nodes/2/properties:simd_count 256
nodes/2/properties:drm_render_minor 129
nodes/2/properties:max_engine_clk_ccompute 3200
"""

# testdata/topology-parsing-mi308/topology/nodes/{0..33}/{gpu_id,properties} (added in d7114784):
# two CPU nodes, then 32 GPUs (MI308 partitions), render minors in steps across the partitions.
# 34 nodes: a lexical sort (0, 1, 10, 11, ...) would put them out of order.
MI308 = """\
nodes/0/gpu_id:0
nodes/0/properties:simd_count 0
nodes/0/properties:drm_render_minor 0
nodes/1/gpu_id:0
nodes/1/properties:simd_count 0
nodes/1/properties:drm_render_minor 0
nodes/2/gpu_id:24248
nodes/2/properties:simd_count 80
nodes/2/properties:drm_render_minor 128
nodes/3/gpu_id:41657
nodes/3/properties:simd_count 80
nodes/3/properties:drm_render_minor 129
nodes/4/gpu_id:59065
nodes/4/properties:simd_count 80
nodes/4/properties:drm_render_minor 130
nodes/5/gpu_id:2236
nodes/5/properties:simd_count 80
nodes/5/properties:drm_render_minor 131
nodes/6/gpu_id:22879
nodes/6/properties:simd_count 80
nodes/6/properties:drm_render_minor 136
nodes/7/gpu_id:42334
nodes/7/properties:simd_count 80
nodes/7/properties:drm_render_minor 137
nodes/8/gpu_id:57694
nodes/8/properties:simd_count 80
nodes/8/properties:drm_render_minor 138
nodes/9/gpu_id:3931
nodes/9/properties:simd_count 80
nodes/9/properties:drm_render_minor 139
nodes/10/gpu_id:16964
nodes/10/properties:simd_count 80
nodes/10/properties:drm_render_minor 144
nodes/11/gpu_id:48709
nodes/11/properties:simd_count 80
nodes/11/properties:drm_render_minor 145
nodes/12/gpu_id:64069
nodes/12/properties:simd_count 80
nodes/12/properties:drm_render_minor 146
nodes/13/gpu_id:5184
nodes/13/properties:simd_count 80
nodes/13/properties:drm_render_minor 147
nodes/14/gpu_id:28521
nodes/14/properties:simd_count 80
nodes/14/properties:drm_render_minor 152
nodes/15/gpu_id:37736
nodes/15/properties:simd_count 80
nodes/15/properties:drm_render_minor 153
nodes/16/gpu_id:55144
nodes/16/properties:simd_count 80
nodes/16/properties:drm_render_minor 154
nodes/17/gpu_id:14701
nodes/17/properties:simd_count 80
nodes/17/properties:drm_render_minor 155
nodes/18/gpu_id:23332
nodes/18/properties:simd_count 80
nodes/18/properties:drm_render_minor 160
nodes/19/gpu_id:42789
nodes/19/properties:simd_count 80
nodes/19/properties:drm_render_minor 161
nodes/20/gpu_id:58149
nodes/20/properties:simd_count 80
nodes/20/properties:drm_render_minor 162
nodes/21/gpu_id:3360
nodes/21/properties:simd_count 80
nodes/21/properties:drm_render_minor 163
nodes/22/gpu_id:23747
nodes/22/properties:simd_count 80
nodes/22/properties:drm_render_minor 168
nodes/23/gpu_id:41154
nodes/23/properties:simd_count 80
nodes/23/properties:drm_render_minor 169
nodes/24/gpu_id:58562
nodes/24/properties:simd_count 80
nodes/24/properties:drm_render_minor 170
nodes/25/gpu_id:2759
nodes/25/properties:simd_count 80
nodes/25/properties:drm_render_minor 171
nodes/26/gpu_id:18392
nodes/26/properties:simd_count 80
nodes/26/properties:drm_render_minor 176
nodes/27/gpu_id:48089
nodes/27/properties:simd_count 80
nodes/27/properties:drm_render_minor 177
nodes/28/gpu_id:65497
nodes/28/properties:simd_count 80
nodes/28/properties:drm_render_minor 178
nodes/29/gpu_id:4572
nodes/29/properties:simd_count 80
nodes/29/properties:drm_render_minor 179
nodes/30/gpu_id:27381
nodes/30/properties:simd_count 80
nodes/30/properties:drm_render_minor 184
nodes/31/gpu_id:38644
nodes/31/properties:simd_count 80
nodes/31/properties:drm_render_minor 185
nodes/32/gpu_id:54004
nodes/32/properties:simd_count 80
nodes/32/properties:drm_render_minor 186
nodes/33/gpu_id:15601
nodes/33/properties:simd_count 80
nodes/33/properties:drm_render_minor 187
"""

MI308_RENDER = (
    128,
    129,
    130,
    131,
    136,
    137,
    138,
    139,
    144,
    145,
    146,
    147,
    152,
    153,
    154,
    155,
    160,
    161,
    162,
    163,
    168,
    169,
    170,
    171,
    176,
    177,
    178,
    179,
    184,
    185,
    186,
    187,
)


def files(recorded: str) -> dict[str, str]:
    """path -> file text, from the `grep -H` form."""
    out: dict[str, str] = {}
    for line in recorded.splitlines():
        path, _, text = line.partition(":")
        out[path] = out.get(path, "") + text + "\n"
    return out


def properties(recorded: str) -> dict[int, str]:
    return {
        int(path.split("/")[1]): text
        for path, text in files(recorded).items()
        if path.endswith("/properties")
    }


def run_probe(topology) -> str:
    """AMD_PROBE as the host runs it, pointed at `topology` (a copy of the KFD topology) instead."""
    script = AMD_PROBE.replace(KFD_NODES, str(topology / "nodes"))
    assert script != AMD_PROBE
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout


def write(topology, recorded: str) -> None:
    for path, text in files(recorded).items():
        (topology / path).parent.mkdir(parents=True, exist_ok=True)
        (topology / path).write_text(text)


# NVIDIA


def test_nvidia_all_gpus():
    assert nvidia_device_args(None, cdi=False) == ["--gpus", "all"]
    assert nvidia_device_args(None, cdi=True) == ["--device", "nvidia.com/gpu=all"]


def test_nvidia_chosen_gpus_with_the_runtime_hook():
    assert nvidia_device_args((0, 1), cdi=False) == ["--gpus", '"device=0,1"']
    assert nvidia_device_args((3,), cdi=False) == ["--gpus", '"device=3"']
    # As it reaches the host's shell: the docker CLI gets the quotes, and reads one CSV field.
    assert (
        shlex.join(["docker", "run", *nvidia_device_args((2, 5), cdi=False)])
        == """docker run --gpus '"device=2,5"'"""
    )


def test_nvidia_chosen_gpus_as_cdi_devices():
    assert nvidia_device_args((0, 1), cdi=True) == [
        "--device",
        "nvidia.com/gpu=0",
        "--device",
        "nvidia.com/gpu=1",
    ]
    assert nvidia_device_args((6,), cdi=True) == ["--device", "nvidia.com/gpu=6"]


@pytest.mark.parametrize("cdi", [False, True])
def test_nvidia_empty_choice_is_refused(cdi):
    with pytest.raises(ValueError, match="no GPU chosen"):
        nvidia_device_args((), cdi=cdi)


# AMD: the probe and its parsers


def test_parse_amd_render():
    assert parse_amd_render("render 128 136\n") == (128, 136)
    assert parse_amd_render("gids 44 109\nrender 129\nother 1 2\n") == (129,)
    assert parse_amd_render("render\n") == ()
    assert parse_amd_render("") == ()


def test_parse_amd_render_refuses_a_garbled_minor():
    # Skipping it would give every later GPU the render node of the next one.
    with pytest.raises(ValueError):
        parse_amd_render("render 128 x 130")


def test_parse_kfd_properties_on_recorded_topologies():
    assert parse_kfd_properties(properties(TWO_GPUS)) == (128, 129)
    assert parse_kfd_properties(properties(MI308)) == MI308_RENDER


def test_parse_kfd_properties_sorts_nodes_numerically():
    nodes = properties(MI308)
    assert parse_kfd_properties(dict(sorted(nodes.items(), key=lambda item: str(item[0])))) == MI308_RENDER


@pytest.mark.parametrize("recorded, render", [(TWO_GPUS, (128, 129)), (MI308, MI308_RENDER)])
def test_probe_on_recorded_topologies(tmp_path, recorded, render):
    # The probe skips CPU nodes by gpu_id, the Python rule by simd_count: same GPUs, same order.
    write(tmp_path, recorded)
    out = run_probe(tmp_path)
    assert out == "render " + " ".join(map(str, render)) + "\n"
    assert parse_amd_render(out) == render == parse_kfd_properties(properties(recorded))


def test_probe_without_kfd(tmp_path):
    assert run_probe(tmp_path) == "render\n"


# AMD: the flags


def test_amd_all_gpus():
    assert amd_device_args(None, ()) == ["--device", "/dev/kfd", "--device", "/dev/dri"]
    assert amd_device_args(None, MI308_RENDER) == ["--device", "/dev/kfd", "--device", "/dev/dri"]


def test_amd_chosen_gpus():
    assert amd_device_args((0, 2), (128, 129, 130)) == [
        "--device",
        "/dev/kfd",
        "--device",
        "/dev/dri/renderD128",
        "--device",
        "/dev/dri/renderD130",
    ]


def test_amd_chosen_gpus_on_a_recorded_host(tmp_path):
    # GPU 10 is KFD node 12, GPU 31 node 33: indices count GPUs, not nodes.
    write(tmp_path, MI308)
    render = parse_amd_render(run_probe(tmp_path))
    assert amd_device_args((10, 31), render) == [
        "--device",
        "/dev/kfd",
        "--device",
        "/dev/dri/renderD146",
        "--device",
        "/dev/dri/renderD187",
    ]


@pytest.mark.parametrize("gpu", [2, 7, -1])
def test_amd_index_beyond_the_gpus(gpu):
    with pytest.raises(ValueError, match=rf"there is no GPU {gpu}: the KFD topology lists 2 GPUs \(0 to 1\)"):
        amd_device_args((0, gpu), (128, 129))


def test_amd_no_gpu_in_the_topology():
    with pytest.raises(ValueError, match="the KFD topology listed no GPU"):
        amd_device_args((0,), ())


def test_amd_empty_choice_is_refused():
    with pytest.raises(ValueError, match="no GPU chosen"):
        amd_device_args((), (128,))
