"""The verifiers face's MCP toolset (:mod:`orthorl_aligner.tools`) offers exactly the environment's
tools (:data:`server.agent_tools.TOOL_NAMES`), each described by the environment's own docstring."""

from __future__ import annotations

from orthorl_aligner.tools import StagingToolset
from server.agent_tools import TOOL_NAMES, StagingTools


def test_the_toolset_offers_the_environments_tools_described_by_their_docstrings():
    offered = {
        getattr(fn, "tool_name", None) or name: fn
        for name, fn in vars(StagingToolset).items()
        if getattr(fn, "tool", False) is True  # marked by verifiers' @vf.tool
    }
    assert sorted(offered) == sorted(TOOL_NAMES)
    for name, fn in offered.items():
        assert fn.__doc__ and fn.__doc__ == StagingTools.__dict__[name].__doc__
