"""A discrete-event serving simulator that drives the real Scheduler and BlockManager.

from nano_scheduler.sim import Simulator, RooflineCostModel, ModelShape, GPU, synthetic
"""

from nano_scheduler.sim.cost_model import (
    GPU,
    GPU_PRESETS,
    BatchShape,
    CostModel,
    DeviceOnlyModel,
    FittedCostModel,
    ModelShape,
    RooflineCostModel,
)
from nano_scheduler.sim.fleet import FleetSimulator
from nano_scheduler.sim.metrics import RequestRecord, SimResult, format_summary
from nano_scheduler.sim.simulator import Simulator
from nano_scheduler.sim.workload import (
    Request,
    load_azure_trace,
    nano_vllm_bench,
    scale_arrivals,
    synthetic,
)

__all__ = [
    "GPU",
    "GPU_PRESETS",
    "BatchShape",
    "CostModel",
    "DeviceOnlyModel",
    "FittedCostModel",
    "FleetSimulator",
    "ModelShape",
    "Request",
    "RequestRecord",
    "RooflineCostModel",
    "SimResult",
    "Simulator",
    "format_summary",
    "load_azure_trace",
    "nano_vllm_bench",
    "scale_arrivals",
    "synthetic",
]
