"""The mathematical model: the sphere, heads, attention normalisations and kernels, optimal transport,
the field V[μ, Θ], the energy E and the mobility (𝒢², 𝒟).

ARCHITECTURE.md has the layers and what each module does."""
