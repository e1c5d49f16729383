"""Adapters that let inference engines use p2pkv without p2pkv importing them.

* :mod:`p2pkv.integrations.vllm` — a secondary tier shaped like vLLM's P2P tier
  (``lookup`` / ``submit_load`` / ``get_finished_jobs`` / ``on_request_finished`` /
  ``shutdown``), driven from the scheduler thread over a :class:`~p2pkv.BlockingNode`.
"""
