"""kvcache inside other engines: adapters that put kvcache's allocator behind an engine's own cache-manager API.

``kvcache.integrations.fastdeploy``: FastDeploy's ``PrefixCacheManager`` contract, so FastDeploy's
``ResourceManagerV1`` schedules on kvcache's block pool and prefix index. Importing an adapter never imports the
engine; only its ``install()`` does.
"""
