from trainer.models.llama import FLAVORS, Llama, ModelArgs, flops_per_token, model_args_for, num_params

__all__ = ["FLAVORS", "Llama", "ModelArgs", "flops_per_token", "model_args_for", "num_params"]
