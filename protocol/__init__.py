"""slotserve wire contract: message types, codec, version, validation, codes."""

from protocol.enums import ErrorCode, FinishReason, RequestKind

__all__ = ["ErrorCode", "FinishReason", "RequestKind"]
