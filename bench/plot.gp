# Called by plot.sh with: data (a folder with single.dat, shm.dat, gloo.dat:
# "params speedup model" rows), out (the PNG), machine, workers.
set terminal pngcairo size 900,560 enhanced font ",11"
set output out
set title sprintf("gradagg-bench: throughput relative to one process (%s workers; %s)", workers, machine)
set xlabel "model parameters (MLP, log scale)"
set ylabel "speedup vs single process"
set logscale x
set format x "10^{%L}"
set xrange [300:2e7]
set yrange [0:*]
set offsets 0, 0, graph 0.08, 0
set grid xtics ytics mxtics
set key top left
set style data linespoints
plot data."/single.dat" using 1:2 title "single (1 process)" lw 2 pt 7 lc rgb "#777777", \
     data."/shm.dat"    using 1:2 title "shm (gradagg)"      lw 2 pt 5 lc rgb "#1f77b4", \
     data."/gloo.dat"   using 1:2 title "gloo (c10d, DDP style)" lw 2 pt 9 lc rgb "#d62728", \
     data."/single-kept.dat" using 1:2 title "single, kept heap" lw 2 pt 6 dt 3 lc rgb "#777777", \
     data."/ceiling.dat" using 1:2 title sprintf("ceiling (%s independent processes)", workers) lw 2 pt 4 dt 2 lc rgb "black", \
     data."/shm.dat"    using 1:2:3 with labels offset 0,1 font ",9" notitle
