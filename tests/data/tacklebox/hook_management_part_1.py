# TackleBox 1.0.3, "Hook Management - part 1.ipynb", its code cells as a script, ported: CPU, random weights and a
# synthetic image in place of CUDA and CIFAR100 (lines marked "port"); cells that only displayed a value print it.
import torch
import torch.nn as nn
from torchvision.models import resnet18

if __name__ == '__main__':
    torch.manual_seed(0)  # port
    x = torch.rand(1, 3, 224, 224)  # port: the first CIFAR100 image, resized to 224x224

    resnet = resnet18()

    # import tacklebox and initialize the hook manager\
    from tacklebox.hook_management import HookManager
    hookmngr = HookManager()

    # forward hook function signature: (module, inputs, outputs)

    # define function print_shape that prints the shape of the first tensor in outputs
    def print_shape(module, inputs, outputs):
        output, *_ = outputs
        print('%s output shape: ' % module.name, output.shape)

    # register print_shape with resnet.conv1, naming it myconv for reference
    hookmngr.register_forward_hook(print_shape, hook_fn_name='print_shape', myconv=resnet.conv1)

    # lookup the HookFunction wrapper for print_shape
    print(hookmngr.name_to_hookfn['print_shape'].name)  # port: displayed

    # lookup the module named myconv
    print(type(hookmngr.name_to_module['myconv']).__name__)  # port: displayed

    # lookup the HookHandle for print_shape registered to myconv
    print(hookmngr.name_to_hookhandle['print_shape[myconv]'].name)  # port: displayed

    # now register the same method with resnet.layer1, naming it mylayer and leaving it deactivated
    hookmngr.register_forward_hook(print_shape, mylayer=resnet.layer1, activate=False)

    # note that we didnt need to name the hook function again

    # lookup our new module, mylayer
    print(type(hookmngr.name_to_module['mylayer']).__name__)  # port: displayed

    # lookup the HookHandle for print_shape registered to mylayer
    print(hookmngr.name_to_hookhandle['print_shape[mylayer]'].name)  # port: displayed

    # lookup all HookHandles corresponding to the print_shape hook function
    print([h.name for h in hookmngr.name_to_hookfn['print_shape'].handles])  # port: displayed

    # lets test the hook function
    with torch.no_grad():
        resnet(x)

    # activate hooks registered to mylayer
    hookmngr.activate_module_hooks_by_name('mylayer')

    with torch.no_grad():
        resnet(x)

    # deactivate all hooks
    hookmngr.deactivate_all_hooks()

    with torch.no_grad():
        resnet(x)

    with torch.no_grad():
        # use python context to activate hook registered to mylayer, then deactivate it after forward pass
        with hookmngr.hook_module_context_by_name('mylayer'):
            resnet(x)

        resnet(x)  # hook doesnt execute once we exit context

    # use context to activate all hooks, combining context with torch.no_grad()
    with hookmngr.hook_all_context() + torch.no_grad():
        resnet(x)
        print(torch.is_grad_enabled())
