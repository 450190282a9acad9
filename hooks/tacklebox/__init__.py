"""TackleBox's API (version 1.0.3) on top of :mod:`hooks`: change only the import line of TackleBox code.

``from tacklebox.hook_management import HookManager`` becomes ``from hooks.tacklebox import HookManager``;
``from tacklebox.hooks.model_tracking import ModuleTracker, TrackingProtocol`` becomes
``from hooks.tacklebox import ModuleTracker, TrackingProtocol``. See the hooks guide for what differs.
"""

from .context import HookContext
from .manager import HookFunction, HookHandle, HookManager
from .tracking import ModuleTracker, TrackingProtocol

__all__ = ["HookContext", "HookFunction", "HookHandle", "HookManager", "ModuleTracker", "TrackingProtocol"]
