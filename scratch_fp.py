import numpy as np, math, time, torch
import transformer_pde as tp
from transformer_pde.studies.noisy import *
beta=1.0; Tc=tp.theory.critical_temperature(beta,2,normalization="unnormalized"); T=0.5*Tc
r0=lambda th: 1+0.5*np.cos(th)
t=time.time()
A=fokker_planck_circle(r0,[1.0],beta=beta,lam=1.0,T=T,modes=64,dt=2e-3)[1.0]
B=fokker_planck_circle(r0,[1.0],beta=beta,lam=1.0,T=T,modes=128,dt=1e-3)[1.0]
print(time.time()-t, np.abs(A[:20]-B[:20]).max(), np.abs(B[:12]))
# linear check: mode-1 growth rate small amplitude
eps=1e-6
C=fokker_planck_circle(lambda th:1+eps*np.cos(th),[0.5],beta=beta,lam=1.0,T=T,modes=32,dt=1e-3)[0.5]
r1=float(tp.theory.mode_growth_rates(beta,2,T,1,normalization="unnormalized")[1])
print(math.log(abs(C[1])*2*math.pi*2/eps)/0.5, r1)
m=2048
qa=circle_quantile(np.arange(m)/m, circle_cell_masses(B,m), cells=True)
qb=circle_quantile(np.arange(512)/512, circle_cell_masses(B,512), cells=True)
print("cells 2048 vs 512", circle_w2(qa,qb))
qc=circle_quantile(np.arange(m)/m, circle_cell_masses(A,m), cells=True)
print("modes64 vs 128", circle_w2(qa,qc))
