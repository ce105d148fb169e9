"""Reads on a user-supplied ``mpu`` object, shaped as DeepSpeed 0.19's inference engine and ZeRO helpers read it."""

import torch


class InferenceEngine:
    def __init__(self, mpu=None):
        self.mpu = mpu

    def model_parallel_size(self):
        if self.mpu:
            return self.mpu.get_tensor_model_parallel_world_size()
        return 1


def data_parallel_rank_and_size(mpu):
    return mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()


def all_reduce_over_model_parallel(tensor, mpu):
    torch.distributed.all_reduce(tensor, group=mpu.get_model_parallel_group())
    return tensor
