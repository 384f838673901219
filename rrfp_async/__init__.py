"""rrfp_async: readiness-first pipeline-parallel training steps on asyncio."""
