"""CDI (Container Device Interface) specs: a typed model, schema validation and atomic writes."""

from cdi.schema import SchemaError, validate
from cdi.spec import ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, SpecError
from cdi.writer import SpecWriter, atomic_write

__all__ = [
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Hook",
    "Mount",
    "SchemaError",
    "Spec",
    "SpecError",
    "SpecWriter",
    "atomic_write",
    "validate",
]
