"""bench.py's networks and data: the MLPs and the three "real" models of the C++ bench.

The same architectures as bench/nets.h, bench/nets.cpp (gradagg-bench -m cnn,transformer,lstm):
  cnn          [B, 1, 28, 28] floats: Conv2d(1,32,3,p1)-BatchNorm2d-ReLU-MaxPool2d(2),
               Conv2d(32,64,3,p1)-BatchNorm2d-ReLU-MaxPool2d(2), Dropout(0.25), flatten,
               Linear(3136,128)-ReLU-Linear(128,10)
  transformer  [B, 32] int64 tokens below 1000: Embedding(1000,128), TransformerEncoder of 4
               layers (d_model 128, 4 heads, feed-forward 512, dropout 0.1), mean over the
               sequence, Linear(128,10)
  lstm         [B, 32, 32] floats: LSTM(32,128,num_layers=2), its last time step, Linear(128,10)
A model is named by a spec: a layer list like [784, 64, 64, 10] (an MLP with ReLU) or one of
"cnn", "transformer", "lstm". Its parameters and its global batch are the same on every call.
"""
import torch

CLASSES = 10       # the real models' classes (kClasses)
SEQUENCE = 32      # the transformer's and the LSTM's steps (kSequence)
VOCABULARY = 1000  # the transformer's tokens are below this (kVocabulary)
FEATURES = 32      # floats per LSTM step (kFeatures)


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(32)
        self.bn2 = torch.nn.BatchNorm2d(64)
        self.dropout = torch.nn.Dropout(0.25)
        self.fc1 = torch.nn.Linear(64 * 7 * 7, 128)
        self.fc2 = torch.nn.Linear(128, CLASSES)

    def forward(self, x):
        F = torch.nn.functional
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        x = self.dropout(x.flatten(1))
        return self.fc2(torch.relu(self.fc1(x)))


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, dropout=0.1,
                                                 batch_first=True)
        # enable_nested_tensor only matters in eval mode with a padding mask: never here.
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(128, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class Lstm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(FEATURES, 128, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(128, CLASSES)

    def forward(self, x):
        out, _ = self.lstm(x)  # [B, T, 128]
        return self.head(out[:, -1])


REAL = {"cnn": Cnn, "transformer": Transformer, "lstm": Lstm}


def label(spec):
    """The model column: "784-64-64-10", or "cnn", "transformer", "lstm" (gradagg-bench -m)."""
    return spec if isinstance(spec, str) else "-".join(map(str, spec))


def parse(text):
    """The spec of a label (the DDP processes get it on their command line)."""
    return text if text in REAL else [int(v) for v in text.split("-")]


def mlp(layers):
    mods = []
    for i in range(len(layers) - 1):
        mods.append(torch.nn.Linear(layers[i], layers[i + 1]))
        if i + 2 < len(layers):
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def build(spec):
    """The model of `spec` in train mode, with the same initial parameters on every call."""
    torch.manual_seed(1)
    return REAL[spec]() if isinstance(spec, str) else mlp(spec)


def batch(spec, size):
    """The global batch (inputs, class labels): the same on every call for the same spec."""
    g = torch.Generator().manual_seed(2)
    if spec == "cnn":
        x = torch.randn(size, 1, 28, 28, generator=g)
    elif spec == "transformer":
        x = torch.randint(0, VOCABULARY, (size, SEQUENCE), generator=g)
    elif spec == "lstm":
        x = torch.randn(size, SEQUENCE, FEATURES, generator=g)
    else:
        x = torch.randn(size, spec[0], generator=g)
    classes = CLASSES if isinstance(spec, str) else spec[-1]
    return x, torch.randint(0, classes, (size,), generator=g)
