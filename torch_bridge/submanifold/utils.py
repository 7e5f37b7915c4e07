"""spconv.pytorch.utils' names: PointToVoxel (torch_bridge.point_to_voxel, imported when first
asked for) and gather_features_by_pc_voxel_id."""

import importlib

import torch


def __getattr__(name):
    if name != "PointToVoxel":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module("torch_bridge.point_to_voxel")
    except ModuleNotFoundError as error:
        if error.name != "torch_bridge.point_to_voxel":
            raise
        raise ImportError("PointToVoxel needs torch_bridge.point_to_voxel, which this "
                          "installation lacks") from error
    return module.PointToVoxel


def gather_features_by_pc_voxel_id(seg_res_features, pc_voxel_id, invalid_value=0):
    """Per point, the features [V, ...] of its voxel (pc_voxel_id [P], -1: none, which gets
    invalid_value): [P, ...] on the features' device."""
    pc_voxel_id = pc_voxel_id.to(seg_res_features.device)
    out = seg_res_features.new_full((pc_voxel_id.shape[0], *seg_res_features.shape[1:]),
                                    invalid_value)
    valid = pc_voxel_id >= 0
    out[valid] = seg_res_features[pc_voxel_id[valid].long()]
    return out
