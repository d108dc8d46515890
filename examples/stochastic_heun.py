"""A solver of your own: the stochastic Heun step for noisy tokens, written against the step protocol.

    dX = V[μ_t, Θ_t](X) dt + √(2T) ∘ dB   on S^{d-1}   (the model's token noise, ``tp.Model(temperature=T)``)

One Gaussian draw z per step (ξ = √(2T dt) z), a predictor x̃ = R(x + dt·V(x) + P_x ξ) and the corrector
R(x + dt/2·(V(x) + V(x̃)) + ½(P_x + P_x̃) ξ), R the geometry's retraction: the Stratonovich trapezoid, where
``tp.Euler()`` takes the projected Euler–Maruyama step.  The class defines ``step`` only; ``ParticleSolver``
gives it the checked problem, progress, callbacks, checkpoints and resume, records, the lazy diagnostics and
the energy ledger (its martingale from ``info["noise"]``).  tests/test_stochastic_heun.py measures its weak
order against Euler–Maruyama on a closed form.

    python examples/stochastic_heun.py        # E⟨x_t, x_0⟩ of one noisy token against e^{−(d−1)Tt}
"""

from __future__ import annotations

import dataclasses

import torch

import transformer_pde as tp
from transformer_pde.solvers.particle.methods import ParticleSolver


@dataclasses.dataclass(frozen=True)
class StochasticHeun(ParticleSolver):
    """The stochastic Heun step (Stratonovich trapezoid with the retraction), two field evaluations a step."""

    stages = 2

    def step(self, state, t, dt):
        """One step from ``state`` (a ``ParticleState``) at t: the new tokens and the noise increment P_x ξ."""
        x, v, retract = state.x, state.velocity, state.geometry.retract
        if state.noise is None:
            xi = torch.zeros_like(x)
        else:
            z = torch.randn(x.shape, generator=state.generator, dtype=x.dtype, device=x.device)
            xi = (2.0 * state.noise.temperature * dt) ** 0.5 * z
        px = tp.sphere.tangent_projection(x, xi)
        x_pred = retract(x + dt * v + px)
        v_pred = state.field(x_pred, 1.0)
        noise = 0.5 * (px + tp.sphere.tangent_projection(x_pred, xi))
        return retract(x + 0.5 * dt * (v + v_pred) + noise), {"noise": px}


if __name__ == "__main__":
    # one token per system (no interaction): E⟨x_t, x_0⟩ = e^{−(d−1)Tt} for Brownian motion on S²
    T, t1, n_paths = 0.5, 1.0, 20000
    x0 = torch.nn.functional.normalize(torch.ones(n_paths, 1, 3, dtype=torch.float64), dim=-1)
    model = tp.Model(tp.Heads.scalar([1.0], 3).to(torch.float64), temperature=T)
    exact = torch.exp(torch.tensor(-2 * T * t1, dtype=torch.float64))
    for solver in (tp.Euler(), StochasticHeun()):
        traj = tp.solve(model, x0, solver, t1=t1, dt=0.125, seed=1, saveat=tp.SaveAt(ends=True))
        m = (traj.x[-1] * x0).sum(-1).squeeze(-1)
        se = float(m.std() / n_paths ** 0.5)
        print(f"{type(solver).__name__:15s} E<x_t, x_0> = {float(m.mean()):.4f} ± {se:.4f}  (exact {float(exact):.4f})")
