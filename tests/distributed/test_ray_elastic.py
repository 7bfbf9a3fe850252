"""Elastic worker groups without a cluster: the sizes a config can use, Ray's count rounded
down to one (with its one line), and the config rules for ray.min_workers."""

from pathlib import Path

import pytest
from loomtrain.launcher.config_loader import ConfigError, load_config

# launcher.cluster.elastic imports Ray: the tests that need it take the module's `ray_head`
# (which puts the client settings in place, tests/ray_fixtures.py) and import it inside, so that
# collecting this file does not import Ray for the modules that do not use it.

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _cfg(*overrides, world=4):
    return load_config(TINY, ["train.micro_batch_size=2", "train.global_batch_size=8", *overrides], world_size=world)


def test_usable_sizes_are_whole_tp_groups_that_split_the_global_batch(ray_head):
    from loomtrain.launcher.cluster import elastic

    cfg = _cfg()
    assert [n for n in range(1, 9) if cfg.usable_world_size(n)] == [1, 2, 4]
    tp2 = _cfg("parallel.tp=2", "model.n_kv_heads=2")
    assert [n for n in range(1, 9) if tp2.usable_world_size(n)] == [2, 4, 8]
    assert [elastic.largest_usable(cfg, n) for n in (1, 2, 3, 4, 5, 7)] == [1, 2, 2, 4, 4, 4]
    assert elastic.largest_usable(tp2, 1) == 0


def test_rays_count_is_rounded_down_to_a_usable_size_and_said_once(ray_head, monkeypatch, capsys):
    from loomtrain.launcher.cluster import elastic
    from ray.train import ScalingConfig

    cfg = _cfg("ray.num_workers=4", "ray.min_workers=2")
    policy = elastic.UsableElasticPolicy(ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1.0}), cfg)
    monkeypatch.setattr(elastic, "reachable_node_ids", lambda: {"a", "b"})
    three = {"a": {"CPU": 2.0}, "b": {"CPU": 1.0}}
    assert policy._count_possible_workers(three) == 2  # 3 fit; dp 3 x micro 2 does not divide 8
    assert policy._count_possible_workers(three) == 2
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "loomtrain: elastic: the cluster has room for 3 workers, a size that parallel.tp=1 and "
        "train.global_batch_size=8 (micro batch 2) cannot use; using 2"
    ]
    assert policy._count_possible_workers({"a": {"CPU": 2.0}, "b": {"CPU": 2.0}}) == 4
    # a node whose raylet does not answer (crashed, not yet declared dead) is not counted
    assert policy._count_possible_workers({"a": {"CPU": 2.0}, "gone": {"CPU": 2.0}}) == 2
    # with context parallelism a size is a multiple of tp x cp, and the line says both
    cp2 = _cfg("ray.num_workers=4", "ray.min_workers=2", "parallel.cp=2", "train.seq_len=64")
    policy = elastic.UsableElasticPolicy(ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1.0}), cp2)
    assert policy._count_possible_workers(three) == 2
    assert capsys.readouterr().out.splitlines() == [
        "loomtrain: elastic: the cluster has room for 3 workers, a size that parallel.tp=1 x parallel.cp=2 and "
        "train.global_batch_size=8 (micro batch 2) cannot use; using 2"
    ]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["ray.min_workers=5"],
            "ray.min_workers: expected 0 (= ray.num_workers, a fixed size) or 1..ray.num_workers=4",
        ),
        (["ray.min_workers=3"], "ray.min_workers: expected a multiple of parallel.tp=1 whose DP size x"),
        (["ray.elastic_resize_interval_s=0"], "ray.elastic_resize_interval_s: expected a positive number"),
    ],
)
def test_bad_elastic_settings_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _cfg("ray.num_workers=4", *overrides)


def test_min_workers_defaults_to_a_fixed_group():
    ray = _cfg("ray.num_workers=4").ray
    assert (ray.min_workers, ray.least_workers, ray.elastic) == (0, 4, False)
    ray = _cfg("ray.num_workers=4", "ray.min_workers=2").ray
    assert (ray.least_workers, ray.elastic) == (2, True)
