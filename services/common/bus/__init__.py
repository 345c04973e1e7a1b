"""The Redis Streams bus every service talks through: ``Bus`` and the exceptions its handlers raise or meet.

``core`` holds ``Bus`` and its delivery rules, ``adds`` the pipelined publishing, ``consume`` one consume loop,
``errors`` the exceptions. Modules import down that list only (``core`` uses ``adds`` and ``consume``, both use
``errors``), never back up it, and none imports this package's top level.
"""

from services.common.bus.consume import MAX_DELIVERIES, Handler
from services.common.bus.core import POOL_SIZE, Bus
from services.common.bus.errors import RedisFull, Reject, RetryLater

__all__ = ["MAX_DELIVERIES", "POOL_SIZE", "Bus", "Handler", "RedisFull", "Reject", "RetryLater"]
