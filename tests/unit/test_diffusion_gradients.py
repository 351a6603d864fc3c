"""Reward FL's gradient: only through the last K denoising steps, and only into the parts that train."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler

from roll.configs.worker_config import ModelArguments
from roll.models.diffusion.parts import encode_prompts, load_diffusion_parts
from roll.pipeline.diffusion.reward_fl_model import RewardFLModel, merge_lora
from roll.pipeline.diffusion.sampling import SamplingArguments, denoise, gradient_step_mask
from roll.rewards.image_rewards import build_image_reward

TINY = "tiny-diffusion://unet?image_size=8&base_channels=8&text_hidden_size=16"


def test_gradient_steps_are_the_last_k_within_the_timestep_range() -> None:
    timesteps = torch.tensor([750, 500, 250, 0])
    assert gradient_step_mask(timesteps, SamplingArguments(num_inference_steps=4, grad_steps=2)) == [
        False,
        False,
        True,
        True,
    ]
    window = SamplingArguments(num_inference_steps=4, grad_steps=3, max_timestep=300)
    assert gradient_step_mask(timesteps, window) == [False, False, True, True]


def ddim_coefficients(scheduler: DDIMScheduler, timestep: int, previous: int) -> tuple[float, float]:
    """(c, d) of a deterministic DDIM step x' = c x + d eps, computed by hand from the schedule."""
    alpha = scheduler.alphas_cumprod[timestep].double()
    alpha_prev = scheduler.alphas_cumprod[previous].double() if previous >= 0 else torch.tensor(1.0).double()
    c = (alpha_prev / alpha).sqrt()
    d = (1 - alpha_prev).sqrt() - alpha_prev.sqrt() * (1 - alpha).sqrt() / alpha.sqrt()
    return float(c), float(d)


@pytest.mark.parametrize("grad_steps", [1, 2])
def test_two_step_gradient_matches_the_hand_built_case(grad_steps: int) -> None:
    """A linear predictor eps = w x over two DDIM steps: x1 = (c0 + d0 w) x0, x2 = (c1 + d1 w) x1. With K=1 the
    gradient of sum(x2) in w is d1 sum(x1) (x1 a constant); with K=2 it adds (c1 + d1 w) d0 sum(x0)."""
    scheduler = DDIMScheduler(num_train_timesteps=1000, clip_sample=False, set_alpha_to_one=True)
    scheduler.set_timesteps(2)
    (t0, t1), stride = scheduler.timesteps.tolist(), 1000 // 2
    c0, d0 = ddim_coefficients(scheduler, t0, t0 - stride)
    c1, d1 = ddim_coefficients(scheduler, t1, t1 - stride)
    weight = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    x0 = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    args = SamplingArguments(num_inference_steps=2, grad_steps=grad_steps)
    x2 = denoise(lambda sample, t: weight * sample, scheduler, x0, args)
    x2.sum().backward()
    w = weight.item()
    x1 = (c0 + d0 * w) * x0
    assert x2.detach() == pytest.approx(((c1 + d1 * w) * x1).numpy(), rel=1e-6)  # the schedule is float32
    expected = d1 * x1.sum().item()
    if grad_steps == 2:
        expected += (c1 + d1 * w) * d0 * x0.sum().item()
    assert weight.grad.item() == pytest.approx(expected, rel=1e-6)  # the schedule is float32


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["a red circle", "a blue square"]


def tiny_model(trainable: list[str], model_args: ModelArguments | None = None, reference: bool = True) -> RewardFLModel:
    torch.manual_seed(0)
    parts = load_diffusion_parts(TINY)
    return RewardFLModel(parts, build_image_reward("brightness"), trainable, model_args or ModelArguments(), reference)


def grads(module: torch.nn.Module | None) -> list[bool]:
    return [] if module is None else [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in module.parameters()]


@pytest.mark.parametrize("trainable", [["unet"], ["text_encoder"], ["unet", "text_encoder"]])
def test_reward_gradient_reaches_only_the_trainable_parts(trainable: list[str], prompts: list[str]) -> None:
    model = tiny_model(trainable)
    model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=1)
    output = model(**encode_prompts(model.parts.tokenizer, prompts))
    (-output.rewards + output.regulariser).mean().backward()
    assert any(grads(model.unet)) == ("unet" in trainable)
    assert any(grads(model.text_encoder)) == ("text_encoder" in trainable)
    assert not any(grads(model.reference_unet))
    assert [p.requires_grad for p in model.reference_unet.parameters()] == [False] * len(grads(model.reference_unet))


def test_only_the_last_k_unet_calls_record_a_graph(prompts: list[str]) -> None:
    model = tiny_model(["unet"], reference=False)
    model.sampling = SamplingArguments(num_inference_steps=5, grad_steps=2, guidance_scale=2.0)
    graph_kept: list[bool] = []
    model.unet.register_forward_hook(lambda module, args, output: graph_kept.append(output.sample.requires_grad))
    model(**encode_prompts(model.parts.tokenizer, prompts)).rewards.sum().backward()
    assert graph_kept == [False, False, False, True, True]  # one guided call (both halves) per step


def test_regulariser_is_zero_at_the_start_and_grows_when_the_unet_moves(prompts: list[str]) -> None:
    model = tiny_model(["unet"])
    model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=2)
    inputs = encode_prompts(model.parts.tokenizer, prompts)
    assert model(**inputs).regulariser.abs().max().item() == 0
    with torch.no_grad():
        next(model.unet.parameters()).add_(0.1)
    assert model(**inputs).regulariser.min().item() > 0


def test_lora_trains_adapters_only_and_merges_into_the_plain_unet(prompts: list[str]) -> None:
    lora = ModelArguments(lora_rank=4, lora_alpha=8, lora_target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model = tiny_model(["unet"], lora)
    trained = [name for name, p in model.unet.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in name for name in trained)
    with torch.no_grad():
        for name, param in model.unet.named_parameters():
            if "lora_B" in name:
                param.normal_()  # B starts at zero: make the adapters change the output
    plain = tiny_model(["unet"], reference=False).unet
    plain.load_state_dict(merge_lora(dict(model.unet.state_dict()), model.lora_scaling))
    sample, cond = torch.randn(2, 3, 8, 8), model.encode(encode_prompts(model.parts.tokenizer, prompts)["input_ids"])
    with torch.no_grad():
        adapted, merged = model.unet(sample, 10, cond).sample, plain(sample, 10, cond).sample
        model.unet.disable_adapters()
        base = model.unet(sample, 10, cond).sample
    assert torch.allclose(adapted, merged, atol=1e-5)
    assert not torch.allclose(adapted, base, atol=1e-3)


def test_a_latent_model_decodes_through_its_frozen_vae(prompts: list[str]) -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    parts = load_diffusion_parts(TINY)  # 8x8 "latents" of 3 channels
    parts.vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4,
        sample_size=16,
    )
    model = RewardFLModel(parts, build_image_reward("brightness"), ["unet"], ModelArguments(), False)
    model.sampling = SamplingArguments(num_inference_steps=2, grad_steps=1)
    output = model(**encode_prompts(parts.tokenizer, prompts))
    assert output.images.shape == (2, 3, 16, 16) and output.images.min() >= 0 and output.images.max() <= 1
    output.rewards.sum().backward()
    assert any(grads(model.unet)) and not any(grads(model.vae))


def test_gradient_checkpointing_gives_the_same_gradients(prompts: list[str]) -> None:
    gradients, unet_calls = [], []
    for checkpointed in (False, True):
        model = tiny_model(["unet"])
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})  # what deepspeed_train calls
        model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=2)
        calls: list[None] = []
        model.unet.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(None))
        torch.manual_seed(1)
        output = model(**encode_prompts(model.parts.tokenizer, prompts))
        (-output.rewards + output.regulariser).mean().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.unet.parameters() if p.grad is not None]))
        unet_calls.append(len(calls))
    assert unet_calls == [3, 5]  # the 2 gradient steps' UNet passes start again in backward (pre-hooks: the
    # recomputation stops once it has what backward needs)
    assert gradients[0].abs().sum() > 0
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-4, atol=1e-7)


def test_a_bf16_model_samples_trains_and_keeps_float32_log_probs(prompts: list[str]) -> None:
    parts = load_diffusion_parts(TINY, torch.bfloat16)  # the GPU recipe's dtype
    model = RewardFLModel(parts, build_image_reward("redness"), ["unet"], ModelArguments(), True)
    model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=1, guidance_scale=2.0)
    inputs = encode_prompts(parts.tokenizer, prompts)
    output = model(**inputs)
    assert output.images.dtype == torch.bfloat16
    (-output.rewards + output.regulariser).mean().backward()
    assert any(grads(model.unet))
    model.mode = "rollout"
    with torch.no_grad():
        rollout = model(**inputs)
    assert rollout.log_probs.dtype == torch.float32 and torch.isfinite(rollout.log_probs).all()


@pytest.mark.parametrize(("low", "high"), [(1, 1000), (100, 400)])
def test_a_window_that_cuts_the_reward_gradient_is_refused(low: int, high: int) -> None:
    """[1, 1000] leaves out the last step (timestep 0): no step would keep a gradient after the window. [100, 400]
    keeps 250 but not 0: only the regulariser would train. Both are refused, naming the fields."""
    timesteps = torch.tensor([750, 500, 250, 0])
    window = SamplingArguments(num_inference_steps=4, grad_steps=2, min_timestep=low, max_timestep=high)
    with pytest.raises(ValueError, match=f"sampling.min_timestep={low} and sampling.max_timestep={high} leave"):
        gradient_step_mask(timesteps, window)
    scheduler = DDIMScheduler(num_train_timesteps=1000, clip_sample=False, set_alpha_to_one=True)
    with pytest.raises(ValueError, match="cut the reward's gradient"):
        denoise(lambda sample, t: 0.1 * sample, scheduler, torch.randn(1, 3, 4, 4), window)


def test_a_trained_text_encoder_is_anchored_by_the_frozen_one(prompts: list[str]) -> None:
    """The reference predicts from the frozen text encoder's conditioning, so the regulariser measures (and pulls
    back) a text encoder that moved, and its gradient reaches it."""
    model = tiny_model(["text_encoder"])
    model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=2, guidance_scale=2.0)
    inputs = encode_prompts(model.parts.tokenizer, prompts)
    assert model(**inputs).regulariser.abs().max().item() == 0
    with torch.no_grad():
        for param in model.text_encoder.parameters():
            param.add_(0.05 * torch.randn_like(param))
    regulariser = model(**inputs).regulariser
    assert regulariser.min().item() > 0
    regulariser.sum().backward()
    assert any(grads(model.text_encoder))


def test_guidance_conditions_on_the_encoded_empty_prompt(prompts: list[str]) -> None:
    """The unconditional half is the empty prompt as the tokenizer encodes it (here with an end token, as CLIP's
    tokenizer adds), the input the warm start's dropped prompts trained on, not a row of padding."""
    from tokenizers.processors import TemplateProcessing

    parts = load_diffusion_parts(TINY)
    tokenizer = parts.tokenizer
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="$A <eos>", special_tokens=[("<eos>", tokenizer.eos_token_id)]
    )
    model = RewardFLModel(parts, build_image_reward("brightness"), ["unet"], ModelArguments(), False)
    empty = encode_prompts(tokenizer, [""] * len(prompts))["input_ids"]
    assert empty[:, 0].tolist() == [tokenizer.eos_token_id] * len(prompts)
    model.sampling = SamplingArguments(num_inference_steps=2, grad_steps=1, guidance_scale=2.0)
    conditioning: list[torch.Tensor] = []
    model.unet.register_forward_pre_hook(
        lambda module, args, kwargs: conditioning.append(kwargs["encoder_hidden_states"]), with_kwargs=True
    )
    with torch.no_grad():
        model(**encode_prompts(tokenizer, prompts))
        expected = model.text_encoder(input_ids=empty).last_hidden_state
    assert torch.equal(conditioning[0][: len(prompts)], expected)
