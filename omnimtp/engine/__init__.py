"""The engine core: one step loop, request state and events, model-agnostic (see core.py)."""

from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.request import OmniOutput, Request, Status, StepEvent

__all__ = ["EngineConfig", "EngineCore", "OmniOutput", "Request", "Status", "StepEvent"]
