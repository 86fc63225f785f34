"""Engine flags map onto EngineConfig, bad values fail at start with the option's name, the flag
contract (each field's `Flag`) is the one place parsers and checks read, the base modules import
no layer, and the capability table names real flags, hides those of features not implemented
yet and refuses them."""

import argparse
from dataclasses import fields

import pytest

from pagoda_engine import capabilities, cli
from pagoda_engine.config import (ENGINE_SECTIONS, REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, EngineConfig,
                                  add_engine_args, config_from_args, default_max_num_seqs, flagged_fields, flags_by_dest,
                                  resolve_cudagraph_capture_size, resolve_cudagraph_mode, value_fault)


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_cuda_graph_capture_size_flag_defaults_to_every_batch_up_to_vllms_512():
    assert parse().model.max_cudagraph_capture_size is None
    assert parse("--max-cudagraph-capture-size", "64").model.max_cudagraph_capture_size == 64
    assert parse("--enforce-eager").model.enforce_eager is True
    assert resolve_cudagraph_capture_size(256, None) == 256
    assert resolve_cudagraph_capture_size(1024, None) == 512
    assert resolve_cudagraph_capture_size(1024, 768) == 768
    assert resolve_cudagraph_capture_size(128, 768) == 128


@pytest.mark.parametrize("device_type, memory_gib, name, expected", [
    ("cuda", 79.2, "NVIDIA H100 80GB HBM3", 1024),
    ("cuda", 139.8, "NVIDIA H200", 1024),
    ("cuda", 79.2, "NVIDIA A100-SXM4-80GB", 256),  # vLLM's exception
    ("cuda", 44.4, "NVIDIA L40S", 256),
    ("cpu", 0, "", 256),
])
def test_max_num_seqs_defaults_to_vllms_rule_for_the_device(device_type, memory_gib, name, expected):
    assert parse().scheduler.max_num_seqs is None  # decided by the engine core on its device
    assert default_max_num_seqs(device_type, int(memory_gib * (1 << 30)), name) == expected


def test_cudagraph_mode_flag_takes_vllms_names_in_either_case():
    assert parse().model.cudagraph_mode is None  # the default: resolve_cudagraph_mode decides
    assert parse("--cudagraph-mode", "full_decode_only").model.cudagraph_mode == "FULL_DECODE_ONLY"
    assert parse("--cudagraph-mode", "NONE").model.cudagraph_mode == "NONE"


def test_piecewise_graphs_are_the_default_on_one_gpu_and_asked_for_under_tensor_parallelism():
    assert resolve_cudagraph_mode(None) == "FULL_AND_PIECEWISE"  # on one GPU and under TP alike
    assert resolve_cudagraph_mode("FULL_DECODE_ONLY") == "FULL_DECODE_ONLY"
    assert resolve_cudagraph_mode("NONE") == "NONE"


def test_bad_cudagraph_mode_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--cudagraph-mode", "piecewise_only")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("max_cudagraph_capture_size", 0, "--max-cudagraph-capture-size must be >= 1, got 0"),
    ("cudagraph_mode", "FULL", "--cudagraph-mode must be one of FULL_AND_PIECEWISE"),
    ("block_size", 12, "--block-size must be a power of two, got 12"),
    ("gpu_memory_utilization", 1.5, r"--gpu-memory-utilization must be <= 1, got 1.5"),
    ("gpu_memory_utilization", 0, r"--gpu-memory-utilization must be > 0, got 0"),
    ("max_num_seqs", 0, "--max-num-seqs must be >= 1"),
    ("long_prefill_token_threshold", -1, r"--long-prefill-token-threshold must be >= 0 \(0: no cap\)"),
    ("dtype", "int4", "--dtype must be one of auto, bfloat16"),
    ("tool_call_parser", "nope", r"invalid tool call parser: nope \(choose from \{ hermes, "),
])
def test_bad_values_name_the_option(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**{option: value})


def test_long_prefill_token_threshold_flag_reaches_the_scheduler_and_defaults_to_no_cap():
    assert parse().scheduler.long_prefill_token_threshold == 0
    assert parse("--long-prefill-token-threshold", "512").scheduler.long_prefill_token_threshold == 512
    with pytest.raises(ValueError, match="--long-prefill-token-threshold"):
        parse("--long-prefill-token-threshold", "-5")


def test_a_non_integer_long_prefill_token_threshold_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--long-prefill-token-threshold", "abc")
    assert "--long-prefill-token-threshold: invalid int value: 'abc'" in capsys.readouterr().err


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_cuda_graph_size"):
        EngineConfig.from_kwargs(max_cuda_graph_size=8)


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_option_of_the_capability_table_is_an_engine_flag_named_as_the_table_says():
    actions = {action.dest: action for action in _engine_parser()._actions}
    options = [option for feature in capabilities.FEATURES for option in feature.options]
    assert options, "the table names no flags"
    config_fields = {f.name for section in vars(EngineConfig()).values() for f in fields(section)}
    for option in options:
        assert option in config_fields
        assert capabilities.flag_of(option) in actions[option].option_strings


def test_serve_help_shows_only_the_flags_of_features_the_engine_implements(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for feature in capabilities.FEATURES:
        for option in feature.options:
            assert (capabilities.flag_of(option) in help_text) == feature.implemented, option
    assert "not implemented" not in help_text
    assert "--tensor-parallel-size" in help_text and "--max-num-seqs" in help_text


def _asking(action: argparse.Action) -> list[str]:
    """Words that set this flag to something other than its default."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    # A flag with choices asks with its first one other than its default.
    chosen = next((c for c in action.choices if c != action.default), None) if action.choices else None
    return [flag, _VALUES.get(action.dest) or chosen or {int: "2", float: "8.5"}.get(action.type, "/kv")]


_VALUES = {"kv_offload_remote_url": "redis://kv:6379"}

# Flags valid only with another: --nnodes 2 needs ranks to spread over the nodes; a disk tier's
# size needs its directory.
_WITH = {"nnodes": (["--tensor-parallel-size", "2"], "tensor-parallel"),
         "kv_offload_disk_gb": (["--kv-offload-disk-path", "/kv"], None)}


def test_every_flag_of_the_table_parses_and_the_engine_refuses_it_by_name_until_implemented():
    actions = {action.dest: action for action in _engine_parser()._actions}
    for feature in capabilities.FEATURES:
        for option in feature.options:
            words = _asking(actions[option])
            companion, companion_key = _WITH.get(option, ([], None))
            config = parse(*words, *companion)  # hidden from --help or not, the flag parses
            assert [f.key for f, how in capabilities.requested(config, {})] == \
                [f.key for f in capabilities.FEATURES if f.key in (feature.key, companion_key)]
            refusal = capabilities.refusal(config, {})
            if feature.implemented:
                assert refusal is None
            else:
                hint = f"; {feature.hint}" if feature.hint else ""
                assert refusal == f"not implemented in this engine yet: {feature.title} ({' '.join(words)}{hint})"


def test_a_leaderworkerset_group_above_one_pod_asks_for_multi_node_serving():
    (feature,) = [f for f in capabilities.FEATURES if "LWS_GROUP_SIZE" in f.env]
    assert capabilities.requested(parse(), {"LWS_GROUP_SIZE": "1"}) == []
    assert capabilities.requested(parse(), {"LWS_GROUP_SIZE": "2"}) == [(feature, "LWS_GROUP_SIZE=2")]
    assert feature.implemented and capabilities.refusal(parse(), {"LWS_GROUP_SIZE": "2"}) is None
    # Data-parallel engine cores over the nodes (each node its own whole cores) run too.
    assert capabilities.refusal(parse("--data-parallel-size", "2"), {"LWS_GROUP_SIZE": "2"}) is None
    assert capabilities.refusal(parse("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--nnodes", "2"),
                                {}) is None


def test_data_parallel_cores_over_nodes_are_placed_by_node():
    """D cores over N nodes: D / N whole cores a node, from node-rank × D / N; each core's ranks on
    its node (its own ranks_per_node), reached at --data-parallel-address (default --master-addr)."""
    leader = parse("--data-parallel-size", "4", "--nnodes", "2", "-tp", "2", "--master-addr", "10.0.0.1").parallel
    worker = parse("--data-parallel-size", "4", "--nnodes", "2", "-tp", "2", "--master-addr", "10.0.0.1",
                   "--node-rank", "1", "--headless", "--data-parallel-address", "10.0.0.9").parallel
    assert leader.data_parallel_across_nodes and list(leader.local_cores) == [0, 1] and leader.ranks_per_node == 2
    assert list(worker.local_cores) == [2, 3] and worker.dp_address == "10.0.0.9" and leader.dp_address == "10.0.0.1"
    assert not parse("--data-parallel-size", "4").parallel.data_parallel_across_nodes
    # Each core is an engine of its node: its ranks meet on the node, its devices count from the
    # node's first core, its KV tiers take a share of the node's pod, its siblings are at the leader.
    from pagoda_engine.api.server.dp_client import rank_config

    core = rank_config(parse("--data-parallel-size", "4", "--nnodes", "2", "-tp", "2", "--master-addr", "10.0.0.1",
                             "--node-rank", "1", "--headless"), 3).parallel
    assert (core.data_parallel_rank, core.data_parallel_local_start, core.data_parallel_size_local) == (3, 2, 2)
    assert (core.nnodes, core.master_addr, core.dp_address) == (1, "127.0.0.1", "10.0.0.1")
    with pytest.raises(ValueError, match="cannot be used with engine cores on several nodes"):
        EngineConfig.from_kwargs(data_parallel_size=2, nnodes=2, api_server_count=2)


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "3", "-tp", "2"], r"= 2 ranks cannot be spread evenly over --nnodes 3"),
    (["--nnodes", "2", "-tp", "2", "--node-rank", "1"], r"--node-rank 1 runs only its node's ranks: add --headless"),
    (["--nnodes", "2", "-tp", "2", "--headless"], r"--node-rank 0 is the leader"),
    (["--headless"], r"--headless runs a node other than the leader"),
    (["--nnodes", "2", "-tp", "2", "--node-rank", "2", "--headless"], r"--node-rank must be in \[0, 2\)"),
    (["--nnodes", "0"], r"--nnodes must be >= 1"),
    (["--nnodes", "2", "-dp", "3"], r"--data-parallel-size 3 engine cores cannot be spread evenly over --nnodes 2"),
    (["--nnodes", "2", "-dp", "4", "--data-parallel-size-local", "1"], r"each of the 2 nodes runs .* = 2 engine cores"),
    (["--nnodes", "2", "-dp", "4", "--node-rank", "1", "--headless", "--data-parallel-start-rank", "1"],
     r"node-rank 1 runs engine cores 2 to 3"),
    (["--nnodes", "2", "-dp", "2", "--data-parallel-rpc-port", "65534"], r"must leave 5 TCP ports"),
    (["-dp", "2", "--data-parallel-size-local", "1"], r"--data-parallel-size-local place .* they need"),
    (["--nnodes", "2", "-tp", "2", "--data-parallel-rpc-port", "4000"], r"--data-parallel-rpc-port place engine cores"),
    (["-dp", "2", "--data-parallel-address", "10.0.0.1"], r"--data-parallel-address place engine cores"),
])
def test_inconsistent_node_flags_are_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


@pytest.mark.parametrize("flags, message", [
    (["--num-gpu-blocks-override", "1"], r"--num-gpu-blocks-override must be >= 2"),
    (["--kv-offload-cpu-gb", "-1"], r"--kv-offload-cpu-gb must be >= 0, got -1.0"),
    (["--kv-offload-disk-gb", "-1"], r"--kv-offload-disk-gb must be >= 0, got -1.0"),
    (["--kv-offload-cpu-gb", "4", "--no-enable-prefix-caching"], r"they need --enable-prefix-caching"),
    (["--kv-offload-disk-gb", "10"], r"--kv-offload-disk-gb needs --kv-offload-disk-path"),
    (["--kv-offload-remote-url", "http://kv:6379"], r"--kv-offload-remote-url: 'http://kv:6379' is not redis://"),
    (["--kv-offload-remote-url", "redis://a:6379,"], r"--kv-offload-remote-url: '' is not redis://"),
    (["--kv-offload-remote-url", "redis://a:6379,redis://a:6379"], r"names a server twice"),
])
def test_bad_kv_offload_flags_are_refused_before_anything_loads(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_step_launch_pacing_is_left_to_the_engine_core_unless_given():
    assert parse().scheduler.step_launch_pacing is None  # on where a step runs on a GPU (EngineCore decides)
    assert parse("--step-launch-pacing").scheduler.step_launch_pacing is True
    assert parse("--no-step-launch-pacing").scheduler.step_launch_pacing is False
    assert EngineConfig().scheduler.step_launch_pacing is False  # the offline LLM's and from_kwargs' default


@pytest.mark.parametrize("flags, message", [
    (["--no-async-scheduling"], r"--step-launch-pacing paces async scheduling: it needs --async-scheduling"),
    (["-pp", "2"], r"does not apply under pipeline parallelism"),
    (["-dp", "2", "--enable-expert-parallel"], r"does not apply when experts span data-parallel engine cores"),
])
def test_step_launch_pacing_is_refused_where_no_step_is_in_flight_to_time(flags, message):
    with pytest.raises(ValueError, match=message):
        parse("--step-launch-pacing", *flags)
    parse(*flags)  # the same flags without it are fine


def test_a_headless_node_runs_its_share_of_the_ranks():
    pc = parse("--nnodes", "2", "-tp", "4", "-pp", "2", "--node-rank", "1", "--headless").parallel
    assert (pc.world_size, pc.ranks_per_node, pc.store_port()) == (8, 4, 29501)
    assert parse("-tp", "2").parallel.store_port() == 0  # one node: any free port


def test_a_headless_node_refuses_more_than_one_api_server():
    node = dict(nnodes=2, tensor_parallel_size=2, node_rank=1, headless=True)
    with pytest.raises(ValueError, match=r"--api-server-count=3 cannot be used with --headless \(no API servers"):
        EngineConfig.from_kwargs(**node, api_server_count=3)
    assert EngineConfig.from_kwargs(**node).server.api_server_count == 1  # the default passes
    assert EngineConfig.from_kwargs(nnodes=2, tensor_parallel_size=2, api_server_count=3).server.api_server_count == 3


def test_refusal_names_every_missing_feature_in_table_order():
    config = parse("--pipeline-parallel-size", "2", "--enable-expert-parallel", "--kv-offload-disk-path", "/kv", "--kv-offload-disk-gb", "100")
    missing = [f for f, _ in capabilities.requested(config, {}) if not f.implemented]
    refusal = capabilities.refusal(config, {})
    assert (refusal is None) == (not missing)
    if missing:
        assert refusal.startswith("not implemented in this engine yet: ")
        assert [refusal.index(f.title) for f in missing] == sorted(refusal.index(f.title) for f in missing)
    if "kv-offload-disk" in {f.key for f in missing}:
        assert "KV offload tiers on local disk (--kv-offload-disk-path /kv, --kv-offload-disk-gb 100.0)" in refusal
    # Defaults, and what the engine implements, ask for nothing it lacks.
    assert capabilities.refusal(parse("--tensor-parallel-size", "2", "--pipeline-parallel-size", "1"), {"LWS_GROUP_SIZE": "1"}) is None


def test_the_parser_names_of_the_contract_are_the_parsers_the_server_has():
    from pagoda_engine.api.reasoning_parsers import REASONING_PARSERS
    from pagoda_engine.api.tool_parsers import TOOL_PARSERS

    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSER_NAMES
    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES


def test_every_default_is_inside_its_own_flag_s_contract():
    config = EngineConfig()
    for section in vars(config).values():
        for f in fields(section):
            flag = f.metadata.get("flag")
            if flag is not None:
                assert value_fault(flag, getattr(section, f.name)) is None, f.name
    parse()  # and the command line's defaults


def test_the_parser_is_built_from_the_contract():
    """Every flagged field has its flag, with the Flag's spellings and choices, and its bounds are
    what EngineConfig.validate enforces (at the bound, and just past it)."""
    actions = {action.dest: action for action in _engine_parser()._actions}
    engine_fields = [(f, flag) for _, f, flag in flagged_fields(*ENGINE_SECTIONS, EngineConfig)]
    assert len(engine_fields) > 40
    for f, flag in engine_fields:
        action = actions[f.name]
        # A switch on by default also takes its --no- form.
        assert tuple(action.option_strings)[:len(flag.spellings(f.name))] == flag.spellings(f.name)
        if flag.choices_in_parser and flag.choices is not None:
            assert tuple(action.choices) == flag.choices
    bounded = {dest: flag for dest, flag in flags_by_dest().items() if flag.min is not None}
    assert "tensor_parallel_size" in bounded and "max_chat_messages" in bounded
    for dest, flag in bounded.items():
        EngineConfig.from_kwargs(**{dest: flag.min, **({"nnodes": 1} if dest == "node_rank" else {})})
        with pytest.raises(ValueError, match=f"{flag.spellings(dest)[0]} must be >= "):
            EngineConfig.from_kwargs(**{dest: flag.min - 1})
