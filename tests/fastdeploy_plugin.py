"""pytest plugin: run FastDeploy's own tests with kvcache's cache manager in place of FastDeploy's.

Load it with ``-p fastdeploy_plugin`` (this folder on ``PYTHONPATH``, FastDeploy's sources too). At start-up it
calls ``kvcache.integrations.fastdeploy.install()``, so every ``PrefixCacheManager`` FastDeploy's code or tests
build is kvcache's ``FastDeployCacheManager``, and it deselects the tests of
``tests/cache_manager/test_prefix_cache_manager.py`` listed in ``OUT_OF_SCOPE`` (each with its reason; the
summary line counts them as deselected). Options:

- ``--fd-platform-cuda``: FastDeploy's platform reports CUDA (``current_platform.is_cuda()`` is true), which
  its v1 scheduler tests need on a CPU machine (elsewhere its engine args turn the v1 scheduler off).
- ``--fd-no-kvcache``: leave FastDeploy's own manager in place (the baseline run).
- ``--fd-kvcache-no-hits``: kvcache's manager forgets every cached prefix before each match, so nothing ever
  hits: shows which tests judge prefix hits.
- ``--fd-all``: run the out-of-scope tests too.
"""
from __future__ import annotations

import pytest

_TREE = "reads or patches the radix tree's internals (radix_tree_root, BlockNode, node maps, build_path, "\
        "mm_match_block, LRU leaf heaps, eviction futures), which kvcache replaces with its pool and prefix index"
_SWAP = "needs CPU swap space (num_cpu_blocks > 0), which the adapter refuses by name"
_STORAGE = "needs a storage backend, which the adapter refuses by name"
_VACUOUS = "calls a private helper of FastDeploy's tree and passes only because it is missing (any exception " \
           "passes) or untouched; it judges nothing of kvcache"

OUT_OF_SCOPE: dict[str, str] = {
    "test_build_path_extends_tree": _TREE,
    "test_cache_output_blocks_updates_leaf_and_recycles_redundant_block": _TREE,
    "test_can_allocate_gpu_blocks_triggers_free_when_prefix_enabled": _TREE + " (it empties gpu_free_block_list "
                                                                       "and expects free_block_ids to be called)",
    "test_free_block_ids_async_consumes_finished_future": _TREE,
    "test_free_block_ids_async_recycles_gpu_nodes": _TREE,
    "test_free_gpu_block_ids_flushes_cache_gone_with_as_only_flush": _STORAGE,
    "test_free_nodes_directly_handles_gpu_leafs": _TREE,
    "test_free_nodes_directly_logs_error_and_raises_when_tree_normal": _TREE,
    "test_free_nodes_directly_recovers_chain": _TREE,
    "test_mm_build_path_creates_new_nodes": _TREE,
    "test_mm_build_path_tracks_unfilled_block_ids": _TREE,
    "test_mm_match_block_handles_multimodal_inputs": _TREE,
    "test_release_block_ids_cleans_request_state": _TREE,
    "test_release_block_ids_recycles_unfilled_blocks_for_root": _TREE,
    "test_request_match_blocks_raises_when_gpu_unavailable": _TREE,
    "test_request_match_blocks_raises_with_paddle_tensor_prompt": _TREE,
    "test_request_match_blocks_with_numpy_prompt_and_metric_reset": _TREE,
    "test_update_cache_blocks_ignores_exception_when_tree_not_normal": _TREE,
    "test_update_cache_blocks_raises_when_tree_normal_on_exception": _TREE,
    "test_update_cache_blocks_refreshes_mappings": _TREE,
    "test_handle_swap_result_ignores_none_node": _TREE,
    "test_check_validity_raises_when_memory_is_insufficient": _VACUOUS,
    "test_free_block_ids_async_returns_for_pending_future": _VACUOUS,
    "test_request_match_blocks_updates_metrics": _SWAP,
    "test_allocate_and_recycle_cpu_blocks": _SWAP,
    "test_free_block_ids_async_swaps_to_cpu": _SWAP,
    "test_free_cpu_block_ids_eviction": _SWAP,
    "test_free_cpu_block_ids_removes_recyclable_leaf": _SWAP,
    "test_handle_swap_result_updates_status": _SWAP,
    "test_issue_swap_task_sync_path": _SWAP,
    "test_launch_cache_manager_formats_value_cache_shape": _SWAP,
    "test_launch_cache_manager_initializes_processes": _SWAP,
    "test_match_block_moves_cpu_nodes_to_swap": _SWAP,
    "test_prepare_cache_allocates_for_cpu_matches": _SWAP,
    "test_prepare_cpu_cache_dispatches_swap": _SWAP,
    "test_recv_data_transfer_result_processes_queue": _SWAP,
    "test_reset_clears_internal_state": _SWAP,
    "test_reset_waits_for_inflight_and_futures": _SWAP,
    "test_recv_data_transfer_result_handles_storage_events": _STORAGE,
    "test_request_match_blocks_prefetches_storage_and_recycles_unused_blocks": _STORAGE,
    "test_request_match_blocks_storage_allocate_failure_raises": _STORAGE,
    "test_storage_task_helpers_cover_sync_paths": _STORAGE,
    "test_write_cache_to_storage_and_key_mismatch_error": _STORAGE,
    "test_request_block_ids_combines_matched_and_unique_blocks": "the v0 scheduler's request_block_ids, which the "
                                                                 "adapter refuses by name",
}
_OUT_OF_SCOPE_FILE = "tests/cache_manager/test_prefix_cache_manager.py"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastdeploy")
    group.addoption("--fd-platform-cuda", action="store_true", help="FastDeploy's platform reports CUDA")
    group.addoption("--fd-no-kvcache", action="store_true", help="keep FastDeploy's own PrefixCacheManager")
    group.addoption("--fd-kvcache-no-hits", action="store_true", help="kvcache's manager never finds a prefix")
    group.addoption("--fd-all", action="store_true", help="run the out-of-scope tests too")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--fd-platform-cuda"):
        from fastdeploy.platforms import current_platform

        current_platform.is_cuda = lambda: True
    if not config.getoption("--fd-no-kvcache"):
        from kvcache.integrations import fastdeploy as adapter

        adapter.install()
        if config.getoption("--fd-kvcache-no-hits"):
            from fastdeploy.cache_manager import prefix_cache_manager

            prefix_cache_manager.PrefixCacheManager = _no_hits_class()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fd-no-kvcache") or config.getoption("--fd-all"):
        return
    kept, dropped = [], []
    for item in items:
        in_file = item.nodeid.split("::")[0].endswith(_OUT_OF_SCOPE_FILE)
        (dropped if in_file and item.name in OUT_OF_SCOPE else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    from fastdeploy.cache_manager import prefix_cache_manager

    cls = prefix_cache_manager.PrefixCacheManager
    return f"fastdeploy PrefixCacheManager: {cls.__module__}.{cls.__qualname__}"


def _no_hits_class() -> type:
    from kvcache.integrations.fastdeploy import FastDeployCacheManager

    class NoHits(FastDeployCacheManager):
        """kvcache's manager with every prefix forgotten before each match (a baseline without hits)."""

        def request_match_blocks(self, task, block_size, *args):
            self.reset_prefix_cache()
            return super().request_match_blocks(task, block_size, *args)

    return NoHits

