"""torchvision's ResNet-18 (with its BatchNorm), adapted to small images and the task's classes."""

from torch import nn
from torchvision.models import resnet18 as tv_resnet18


def resnet18(num_classes, input_shape):
    """torchvision.models.resnet18(num_classes=...), first conv 3x3 stride 1 on the input's
    channels and no max-pool (the usual CIFAR/MNIST adaptation); BatchNorm2d throughout."""
    model = tv_resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
