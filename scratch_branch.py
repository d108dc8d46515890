import numpy as np, math, time
import transformer_pde as tp
from transformer_pde.studies.noisy import fokker_planck_circle
from transformer_pde.theory import noise as tn
for beta in [1.0, 4.0]:
    Tc=tp.theory.critical_temperature(beta,2,normalization="unnormalized")
    print("beta",beta,"Tc",Tc,"landau",tn.landau_coefficient(beta,2))
    for r in [0.8,0.9,0.95,1.0,1.05,1.1,1.15,1.2,1.3]:
        T=r*Tc
        c=fokker_planck_circle(lambda th: np.exp(8*np.cos(th)),[60.0/Tc] if False else [round(40/Tc/0.002)*0.002],beta=beta,lam=1.0,T=T,modes=128,dt=0.002)
        cc=list(c.values())[0]
        print(f"  r={r}: |m| cluster-start = {2*math.pi*abs(cc[1]):.4f}", flush=True)
