import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
keys=['timing_s/gen','timing_s/old_log_prob','timing_s/update_actor','timing_s/update_weights','timing_s/testing','timing_s/adv','timing_s/save_checkpoint','timing_s/reward','timing_s/step']
print('step '+' '.join(k.split('/')[1][:10].rjust(10) for k in keys))
for r in rows:
    d=r.get('data',r)
    if 'timing_s/step' not in d: continue
    print(str(r.get('step')).rjust(4), ' '.join(f"{d.get(k,float('nan')):10.2f}" for k in keys))
extra=sorted(k for k in rows[-1].get('data',rows[-1]) if k.startswith('timing_s'))
print(extra)
