import torch, torchvision, time
from attribution.perturbation._incremental import IncrementalRunner, trace
torch.set_num_threads(1)
torch.manual_seed(0)
m = torchvision.models.resnet50(weights=None).eval()
x = torch.randn(1, 3, 224, 224)
g = trace(m)
with torch.no_grad():
    r = IncrementalRunner(g, x)
    xb = x.repeat(7,1,1,1)
    t=time.process_time(); m(xb); print("full per row (batch 7)", (time.process_time()-t)/7)
    for box in [((0,56),(0,56)), ((84,140),(84,140))]:
        y = x.clone(); y[..., box[0][0]:box[0][1], box[1][0]:box[1][1]] = 0
        t=time.process_time(); o=r.run(y, box); print("incr", box, time.process_time()-t, (o-m(y)).abs().max().item())
